"""The gated MLP's activations on a fused gate_up projection: SiLU-and-multiply (Llama, Qwen),
GELU-and-multiply (Gemma); a C++ pass each on CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.direct_call import DirectCall


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Hugging Face's two ops, any dtype and device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(DirectCall, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.impl: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_torch

    def choose_impl(self, device: torch.device, dtype: torch.dtype) -> None:
        """On CPU, one C++ pass instead of three ops (within a rounding or so of them)."""
        if cpu_ops.serves_layer_ops(device, dtype):
            self.impl = cpu_ops.silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]."""
        return self.impl(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: GELU (tanh approximation, transformers' gelu_pytorch_tanh) of the gate
    times up, in Hugging Face's ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(DirectCall, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.impl: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul

    def choose_impl(self, device: torch.device, dtype: torch.dtype) -> None:
        """On CPU, one C++ pass instead of three ops (within a rounding or so of them)."""
        if cpu_ops.serves_layer_ops(device, dtype):
            self.impl = cpu_ops.gelu_tanh_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]."""
        return self.impl(gate_up)
