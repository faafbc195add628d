"""The layers models are built from, one job per file: RMSNorm (layernorm.py), SiLU-and-multiply
(activation.py), projections split for tensor parallelism (linear.py), the rotary tables
(rotary.py), the LM head (lm_head.py). Attention is attention/backend.py's.

A layer computes with PyTorch ops, correct on any device, until `choose_impls` has it choose,
once, what it runs on the device and dtype the model now has (a C++ pass on CPU, weights packed
for the few-rows kernel or oneDNN, whichever was timed faster: linear_dispatch.py); its forward
then calls that choice without asking again.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pagedllm.config import LinearBackend
from pagedllm.layers.linear import Linear
from pagedllm.layers.linear_dispatch import LinearDispatch


@runtime_checkable
class ChoosesImpl(Protocol):
    def choose_impl(self, device: torch.device, dtype: torch.dtype) -> None:
        """Pick the implementation forward calls from now on (packing weights where it needs)."""


def choose_impls(
    model: nn.Module, device: torch.device, dtype: torch.dtype, linear_backend: LinearBackend = "auto"
) -> None:
    """Every layer of `model` chooses its implementation; once, after its weights are loaded.
    Projections share one LinearDispatch (`linear_backend`: auto times the paths), which logs
    what they chose."""
    dispatch = LinearDispatch(linear_backend)
    for module in model.modules():
        if isinstance(module, Linear):
            module.choose_impl(device, dtype, dispatch)
        elif isinstance(module, ChoosesImpl):
            module.choose_impl(device, dtype)
    dispatch.log_summary()
