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
from pagedllm.layers.fused_moe import FusedMoE, Router
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
    modules = list(model.modules())
    for module in modules:  # projections first: a layer made of them chooses from what they chose
        if isinstance(module, Linear):
            module.choose_impl(device, dtype, dispatch)
    for module in modules:
        if isinstance(module, (FusedMoE, Router)):
            module.choose_impl(device, dtype, dispatch)
        elif isinstance(module, ChoosesImpl) and not isinstance(module, Linear):
            module.choose_impl(device, dtype)
    dispatch.log_summary()


def bind_attributes(model: nn.Module) -> None:
    """Put every module's submodules and parameters in its instance __dict__ as well, once its
    layers have chosen: nn.Module keeps them in side dicts that Python reaches only through
    Module.__getattr__, a fallback in Python run on every `self.qkv_proj` or `self.weight`, tens
    of times per layer per step; an entry in __dict__ is found before that fallback. The side
    dicts stay as they are (state_dict, modules(), parameters() read them). Assigning a module or
    parameter through Module.__setattr__ removes the __dict__ entry of that name, so a new one
    is seen; setting one to None or deleting it would leave the entry, and nothing does either
    once a model is prepared. Buffers are left out (their reassignment keeps the entry)."""
    for module in model.modules():
        module.__dict__.update(module._modules)
        module.__dict__.update(module._parameters)
