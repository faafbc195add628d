"""A linear layer that runs fast on CPU.

On CPU in float32, and in bfloat16 where the CPU has bfloat16 instructions, weights are packed
once, after loading, into oneDNN's blocked layout and multiplied with oneDNN (the path
torch.compile's CPU backend takes): faster than unpacked weights for decode-sized products and
the lm_head, as fast for prefill-sized chunks.

Unpacked, few-row products (decode steps) go as W @ Xᵀ, which MKL streams from memory
better than X @ Wᵀ; from about a hundred rows on the usual orientation is as fast or faster.

Where cpu_ops.few_rows_linear serves the CPU and dtype (bfloat16 with AVX512-BF16 but no
AMX; float32 with AVX2 or AVX-512), the weight is packed for it instead, and it computes every
product: it streams the weight at close to the machine's bandwidth where oneDNN reaches about two
thirds of it, and keeps its sums in registers as the rows grow, about oneDNN's speed for prompts.
On AMX, bfloat16 stays with oneDNN's tiles. The timings behind each choice: docs/benchmarks.md,
"Figures behind choices in the code".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu_features import has_fast_bf16
from pagedllm.kernels import cpu_ops

_FEW_ROWS = 96


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, in_features] -> [num_rows, out_features], as F.linear."""
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.device.type != "cpu" or x.shape[0] > _FEW_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing pays on CPU in float32, and in bfloat16 where the CPU has bfloat16
    instructions; elsewhere oneDNN's bfloat16 falls back to slow reference kernels."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and has_fast_bf16())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The same [out_features, in_features] weight in oneDNN's layout for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class Linear(nn.Linear):
    few_rows: bool = False
    """The weight is packed for cpu_ops.few_rows_linear (pack_weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows:
            return cpu_ops.few_rows_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)

    def pack_weight(self) -> None:
        """Replace the weight by its packed copy: for few_rows_linear where that serves this CPU
        and dtype, else for oneDNN where that pays. A weight shared with another module (a tied
        lm_head) is copied instead, so the other module keeps its plain tensor."""
        if self.few_rows or self.weight.layout == torch._mkldnn:
            return
        if cpu_ops.serves_few_rows_linear(self.weight):
            self.weight = nn.Parameter(cpu_ops.pack_few_rows(self.weight.detach()), requires_grad=False)
            self.few_rows = True
        elif can_pack(self.weight):
            self.weight = nn.Parameter(pack(self.weight), requires_grad=False)
