"""LoRA adapters served beside their base model: many at once, one step mixing their rows.

targets.py names the projections an adapter may change; peft_reader.py and gguf_reader.py read an
adapter's file into an Adapter (adapter.py), checked against those targets; store.py keeps the
adapters a server knows and the ones loaded; layers.py adds an adapter's low-rank product to a
projection's output, per group of rows, on top of the base weights as they are held (never merged);
slots.py gives the adapters of a step their places in those layers.
"""
