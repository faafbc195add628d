"""The paths a float projection weight can take on CPU, for layers/linear_dispatch.py to choose from.

- the few-rows kernel (cpu_ops.few_rows_linear: streams the weight at close to the machine's
  bandwidth, made for decode steps);
- oneDNN on its blocked layout (the path torch.compile's CPU backend takes);
- the unpacked weight, for what neither packs (float16; bfloat16 without bfloat16 instructions):
  few-row products go as W @ Xᵀ, which MKL streams from memory better than X @ Wᵀ; from about a
  hundred rows on the usual orientation is as fast or faster.

The timings behind the choice on one host: docs/benchmarks/kernels_and_dispatch.md, "Measured
dispatch (issue 25)".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.cpu_features import has_fast_bf16
from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear_dispatch import FALLBACK, LinearPath

_FEW_ROWS = 96


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """An unpacked weight on CPU: x: [num_rows, in_features] -> [num_rows, out_features]. Unlike
    the packed paths, a row's result may depend on the rows beside it (the two orientations, and
    MKL's own kernels by shape, sum in different orders): it serves only weights neither packed
    path takes (float16; bfloat16 without bfloat16 instructions) and --linear-backend torch."""
    if x.shape[0] > _FEW_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As F.linear, from a weight packed by pack_onednn."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack_onednn(weight: torch.Tensor) -> bool:
    """oneDNN packing pays on CPU in float32, and in bfloat16 where the CPU has bfloat16
    instructions; elsewhere oneDNN's bfloat16 falls back to slow reference kernels."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and has_fast_bf16())


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """The same [out_features, in_features] weight in oneDNN's layout for onednn_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def cpu_paths(weight: torch.Tensor) -> dict[str, LinearPath]:
    """The paths that can take this float weight on CPU, in order of preference: the few-rows
    kernel (one copy of the weight streamed per product), oneDNN, and the unpacked weight."""
    paths = {}
    if cpu_ops.serves_few_rows_linear(weight):
        paths["few_rows"] = LinearPath(cpu_ops.pack_few_rows, cpu_ops.few_rows_linear)
    if can_pack_onednn(weight):
        paths["onednn"] = LinearPath(pack_onednn, onednn_linear)
    paths[FALLBACK] = LinearPath(torch.Tensor.detach, cpu_linear)
    return paths
