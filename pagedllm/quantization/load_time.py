"""Methods --quantization names alone: int8/int4 quantize a float checkpoint at load, none
dequantizes whatever the files hold into --dtype (the reference a quantized run is measured by)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.linear import Linear
from pagedllm.layers.lm_head import ParallelLMHead
from pagedllm.layers.quantization import packed_bits_per_weight, quantize
from pagedllm.quantization.base import QuantizationMethod


class QuantizedAtLoad(QuantizationMethod):
    """Every projection but the LM head quantized per block of 32 (vLLM's habit: the head
    decides the tokens), into the block form a GGUF's Q8_0 / Q4_1 read into."""

    bits: int

    @classmethod
    def check_flag(cls, own: type[QuantizationMethod] | None) -> None:
        if own is not None:
            raise ValueError(
                f"--quantization {cls.name} quantizes a float checkpoint; this {own.held_as} is quantized "
                "already (leave --quantization out to keep its formats, or give none to dequantize it)"
            )

    @classmethod
    def bits_at_load(cls) -> float:
        return packed_bits_per_weight(cls.bits, has_mins=cls.bits == 4)  # quantize(): 4 bits keep mins

    @classmethod
    def after_load(cls, model: nn.Module, dtype: torch.dtype) -> None:
        for module in model.modules():
            if isinstance(module, Linear) and not isinstance(module, ParallelLMHead):
                module.set_quantized(quantize(module.weight, cls.bits))


class Int8(QuantizedAtLoad):
    name = "int8"
    bits = 8


class Int4(QuantizedAtLoad):
    name = "int4"
    bits = 4


class Dequantized(QuantizationMethod):
    """Every quantized weight (projections and the embedding table) dequantized into --dtype."""

    name = "none"

    @classmethod
    def check_flag(cls, own: type[QuantizationMethod] | None) -> None:
        """Applies to any model."""

    @classmethod
    def after_load(cls, model: nn.Module, dtype: torch.dtype) -> None:
        for module in model.modules():
            if isinstance(module, Linear):
                module.dequantize(dtype)
            elif isinstance(module, VocabEmbedding) and module.quantized is not None:
                module.dequantize_into_weight(dtype)
