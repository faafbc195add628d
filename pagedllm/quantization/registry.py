"""The quantization methods pagedllm reads, one row each, and the questions the loader asks of them.

A new format is a module with its QuantizationMethod and one row below: --quantization's check,
the detection in a model's files, the weights' reading and what runs after loading all go through
the row (vLLM's QUANTIZATION_METHODS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.model.checkpoint_quant import CheckpointQuantization
from pagedllm.quantization.awq import AWQ
from pagedllm.quantization.base import HeldByCheckpoint, QuantizationMethod, quant_method
from pagedllm.quantization.compressed_tensors import CompressedTensors
from pagedllm.quantization.fp8 import FP8
from pagedllm.quantization.gguf import GGUF
from pagedllm.quantization.gptq import GPTQ
from pagedllm.quantization.load_time import Dequantized, Int4, Int8

QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {
    "gguf": GGUF,
    "awq": AWQ,
    "gptq": GPTQ,
    "compressed-tensors": CompressedTensors,
    "fp8": FP8,
    "int8": Int8,
    "int4": Int4,
    "none": Dequantized,
}
"""--quantization's values (pagedllm/config.py's Quantization lists the same names) -> the method."""

CHECKPOINT_METHODS = tuple(
    name for name, method in QUANTIZATION_METHODS.items() if issubclass(method, HeldByCheckpoint)
)
"""quantization_config's quant_method values read: vLLM's --quantization names."""

LOAD_TIME_METHODS = tuple(name for name, method in QUANTIZATION_METHODS.items() if method.bits_at_load())
"""--quantization values that quantize a float checkpoint at load."""


def model_quantization(folder: Path) -> QuantizationMethod | None:
    """The method the model in `folder` holds its weights in, read (None: float weights).
    ValueError, saying what is read, for a quantization_config of a method or variant that is not."""
    config = _quantization_config(folder)
    for method in QUANTIZATION_METHODS.values():
        found = method.detect(folder, config)
        if found is not None:
            return found
    if config:
        raise ValueError(
            f"quantization_config: quant_method {quant_method(config)!r} is not supported; pagedllm reads "
            f"{', '.join(CHECKPOINT_METHODS)} checkpoints and GGUF files, and quantizes a float checkpoint "
            "with --quantization int8|int4"
        )
    return None


def read_checkpoint_quantization(folder: Path) -> CheckpointQuantization | None:
    """A safetensors checkpoint's quantization_config, read (None: none, or not a checkpoint's)."""
    method = model_quantization(folder)
    return method.checkpoint if isinstance(method, HeldByCheckpoint) else None


def check_quantization(quantization: str | None, own: str | None) -> None:
    """Refuse --quantization `quantization` where it cannot apply to a model whose files hold
    `own` (a QUANTIZATION_METHODS name; None: float): each method's own rule."""
    if quantization is not None:
        QUANTIZATION_METHODS[quantization].check_flag(QUANTIZATION_METHODS[own] if own else None)


def _quantization_config(folder: Path) -> dict[str, Any] | None:
    config_path = folder / "config.json"
    if not config_path.exists():
        return None
    config = json.loads(config_path.read_text()).get("quantization_config")
    return config or None
