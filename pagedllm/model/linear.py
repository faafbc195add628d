"""A linear layer that picks the faster GEMM orientation on CPU.

For the few-row products of decode steps, MKL streams the weight from memory far better
as W @ Xᵀ than as X @ Wᵀ: measured here over a cache-cold pass of SmolLM2's 30 layers,
64 rows took 120 ms instead of 180 ms, and 2 rows 33 ms instead of 60 ms. From about
a hundred rows on (prefill chunks) the usual orientation is as fast or faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_FEW_ROWS = 96


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, in_features] -> [num_rows, out_features], as F.linear."""
    if x.device.type != "cpu" or x.shape[0] > _FEW_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
