"""RMSNorm with the residual path: the residual is added first when given, and the sum returned
as the new residual. Numerics are Hugging Face's (normalized in float32, then cast back and
scaled), bit for bit in PyTorch ops; the C++ pass on CPU agrees within a float32 rounding or so."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.direct_call import DirectCall

AddRMSNorm = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's steps, any dtype and device."""
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def add_rms_norm_float32(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 only: one fused kernel, bit-identical to add_rms_norm_torch's steps."""
    if residual is not None:
        x = residual + x
    return F.rms_norm(x, weight.shape, weight, eps), x


class RMSNorm(DirectCall, nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.impl: AddRMSNorm = add_rms_norm_torch

    def choose_impl(self, device: torch.device, dtype: torch.dtype) -> None:
        """On CPU, one C++ pass instead of up to nine ops."""
        if cpu_ops.serves_layer_ops(device, dtype):
            self.impl = cpu_ops.add_rms_norm
        elif dtype == torch.float32:
            self.impl = add_rms_norm_float32

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [num_tokens, hidden_size]. Returns (the normed sum, the sum)."""
        return self.impl(x, residual, self.weight, self.eps)
