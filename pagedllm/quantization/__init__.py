"""Quantization as registered methods over one block form (vLLM's model_executor/layers/quantization).

- linear_method.py: how a projection holds and computes with its weight, float or in quantized
  blocks (layers/quantization.py's BlockQuantized, every format's one form); layers/linear.py
  delegates to it. It sits in the layers' layer of tests/test_layering.py.
- base.py: QuantizationMethod, what a format family answers: is a model in it, may a
  --quantization flag apply to it, how its weights read, what runs after loading.
- one module per family (gguf.py, awq.py, gptq.py, compressed_tensors.py, fp8.py, load_time.py), each
  registered by one row of registry.py's QUANTIZATION_METHODS. These read files, so they sit with
  model/ (they read through model/gguf_weights.py and model/checkpoint_quant.py).
"""
