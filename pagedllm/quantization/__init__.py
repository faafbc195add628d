"""Quantization as registered methods over one block form (vLLM's model_executor/layers/quantization).

- base.py: QuantizationMethod, what a format family answers: is a model in it, may a
  --quantization flag apply to it, how its weights read, what runs after loading.
- one module per family (gguf.py, awq.py, gptq.py, compressed_tensors.py, fp8.py, load_time.py), each
  registered by one row of registry.py's QUANTIZATION_METHODS. These read files through
  model/gguf_weights.py and model/checkpoint_quant.py, so the package sits above model/; how a
  projection computes with the blocks is layers/linear_method.py's, below both.
"""
