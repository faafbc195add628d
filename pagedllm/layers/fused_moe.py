"""A mixture of experts: the router's choice of experts per token, and the experts computed grouped
by expert (vLLM's fused_moe, llama.cpp's mul_mat_id).

Each token goes to the top-k experts of the router's softmax (computed in float32, as transformers
computes it, so ties and near ties resolve as torch.topk resolves them there), and its output is
their gated MLPs' outputs weighted by those probabilities (renormalized over the k where the model
says so). A step's tokens are not computed one by one: its (token, expert) pairs are grouped by
expert, and each expert that any token chose runs its gate_up and down projections once over all
its rows, so each expert's weights are read once per step whatever the number of rows routed to
it; an expert no token chose is not read at all.

Each expert is a pair of projections (layers/linear.py), so an expert holds its weight as any
projection does: float, packed for the CPU paths; or in its file's quantized blocks (a GGUF's
ffn_*_exps split per expert, model/gguf_weights.py), packed for the integer kernel and never
dequantized. Children are named by expert index (`experts.3.gate_up_proj`), the names checkpoints
give them. Where every expert is packed for the integer kernel, a step's experts run in two calls
(GroupedExperts: cpu_ops.moe_quant_linear for gate_up, then for down), their tasks shared by the
threads in one parallel region; else in two calls an expert (float experts, or a build without the
kernel). Both give the same bits; the grouped one is the faster (docs/benchmarks/moe.md).

Tensor parallelism splits the experts, not each expert (expert parallelism): rank r of R holds
experts r x E / R up to (r + 1) x E / R, whole, in their file's blocks; the router is whole on
every rank, so every rank chooses the same experts; each computes the pairs routed to its own
experts and the block's output is summed over the ranks, once a layer. Splitting each expert's
width instead would cut a K-quant's 256-column blocks (Qwen3-30B-A3B's experts are 768 wide: 384
a rank), and those weights would be held dequantized.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.linear import Loaded, MergedColumnParallelLinear, RowParallelLinear, copy_weight
from pagedllm.layers.linear_dispatch import LinearDispatch, LinearImpl
from pagedllm.layers.linear_method import FloatLinearMethod
from pagedllm.layers.quantization import BlockQuantized


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, float32_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, num_experts] -> (weights, expert ids), each [num_tokens, top_k]:
    the top-k of the softmax in float32 (ties as torch.topk breaks them), renormalized to sum to 1
    where `renormalize`, the weights in the logits' dtype (transformers' Qwen3MoeTopKRouter), or
    left in float32 where `float32_weights` (its MixtralTopKRouter: each expert's output is then
    weighted in float32 and rounded once to the hidden dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(router_logits.dtype)), expert_ids


PairAligner = Callable[
    [torch.Tensor, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
]
"""align_pairs or cpu_ops.moe_align."""


class Router(DirectCall, nn.Module):
    """The router's projection, [num_experts, hidden_size], kept float whatever the file holds:
    the choice of experts is decided by its logits, so it is not computed from quantized inputs.
    On CPU it takes the float path the projections' dispatch times (a decode step's router through
    oneDNN cost ~0.1 ms a layer, the few-rows kernel ~0.02: docs/benchmarks/moe.md)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.impl: LinearImpl = F.linear

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        """A router stored in quantized blocks is dequantized (exactly) into the float weight."""
        if isinstance(loaded, BlockQuantized):
            loaded = loaded.dequantize(param.dtype)
        copy_weight(param.data, loaded)

    def choose_impl(self, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch) -> None:
        """The float path `dispatch` chooses for the weight, as a float projection's."""
        prepared = FloatLinearMethod().prepare(self.weight, device, dtype, dispatch)
        if prepared.weight is not self.weight:
            self.weight = nn.Parameter(prepared.weight, requires_grad=False)
        self.impl = prepared.impl

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> router logits [num_tokens, num_experts]."""
        return self.impl(hidden, self.weight, None)


class SparseMoeBlock(DirectCall, nn.Module):
    """A sparse layer's MLP: the router, then each token's top-k experts, weighted. The models
    differ only in the top-k's rule (select_experts' renormalize and float32_weights)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        renormalize: bool,
        float32_weights: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights
        self.tp = tp
        self.gate = Router(num_experts, hidden_size)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp)

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> this rank's experts' part of the output."""
        weights, ids = select_experts(self.gate(hidden), self.top_k, self.renormalize, self.float32_weights)
        return self.experts(hidden, weights, ids)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs summed (as is, on one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        return self.reduce(self.routed(hidden))


class ExpertMLP(nn.Module):
    """One expert's weights: gate and up fused (as a dense MLP's), then down; no forward of its own."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, None)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, None)


class FusedMoE(DirectCall, nn.Module):
    """`num_experts` SiLU-gated experts of width `intermediate_size`, computed grouped by expert;
    with `tp`, this rank's share of them (`owns`), and its part of the output."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        rank, ranks = (tp.rank, tp.world_size) if tp is not None else (0, 1)
        self.first, self.end = rank * num_experts // ranks, (rank + 1) * num_experts // ranks
        """This rank's experts: first <= index < end."""
        self.expert_mlps = [ExpertMLP(hidden_size, intermediate_size) for _ in range(self.first, self.end)]
        """This rank's experts (index - first), without nn.Module's lookup by name on every step."""
        for index, mlp in enumerate(self.expert_mlps, self.first):  # a checkpoint's experts.E.*
            self.add_module(str(index), mlp)
        self.act_fn: nn.Module = SiluAndMul()
        self.num_experts = num_experts
        self.grouped: GroupedExperts | None = None
        """The experts' packed weights for the grouped kernel, where every one is packed for it."""
        self.align: PairAligner = align_pairs

    def owns(self, expert: int) -> bool:
        """Whether expert `expert` is this rank's (every one is, on one rank)."""
        return self.first <= expert < self.end

    def choose_impl(self, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch) -> None:
        """After the experts' projections have chosen (layers.choose_impls): on CPU the pairs are
        grouped in one C++ pass; where each expert holds one packed quantized weight for the
        integer kernel, a step's experts run in two grouped calls (gate_up, down) instead of two
        calls an expert."""
        if device.type == "cpu" and cpu_ops.is_built():
            self.align = cpu_ops.moe_align
        projections = [p for mlp in self.expert_mlps for p in (mlp.gate_up_proj, mlp.down_proj)]
        if all(p.weight_format and "+" not in p.weight_format for p in projections):
            self.grouped = GroupedExperts(
                [mlp.gate_up_proj.weight for mlp in self.expert_mlps],
                [mlp.down_proj.weight for mlp in self.expert_mlps],
                dispatch.quant_stream_ahead(),
            )

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size]; topk_weights, topk_ids: [num_tokens, top_k] (from
        select_experts). Returns [num_tokens, hidden_size]: each token's experts' outputs times
        their weights, summed over its k in expert order (transformers adds them in that order, one
        by one; torch.sum accumulates a bfloat16 sum in float32 and rounds it once).

        The pairs, grouped by expert (align_pairs); their rows gathered once, each group computed
        over its slice of them, then each token's k results gathered back and summed:

            topk_ids  [[5, 1], [1, 3], [5, 3]]   ->  pairs (t0,5) (t0,1) (t1,1) (t1,3) (t2,5) (t2,3)
            by expert   1: t0 t1 | 3: t1 t2 | 5: t0 t2   (one gate_up and one down per group)

        No index_add_ (one per expert), whose parallel region costs milliseconds a call where
        another process holds a core (a 1-row add: 12 ms on 2 threads of a busy 2-core host, 6 us
        on one; this block at decode 47 ms with it, 0.34 ms without): one gather and one sum a
        step instead, over all the rows. The price: the pairs' rows held twice, [num_tokens x
        top_k, hidden_size] each (a 2,048-token bfloat16 prefill step of Qwen3-30B-A3B: 64 MiB).
        """
        num_tokens, top_k = topk_ids.shape
        experts, offsets, pair_tokens, pair_weights, where = self.align(
            topk_ids, topk_weights, self.num_experts
        )
        chosen, bounds = experts.tolist(), offsets.tolist()
        low, high = bisect.bisect_left(chosen, self.first), bisect.bisect_left(chosen, self.end)
        start, end = bounds[low], bounds[high]  # this rank's pairs (all of them on one rank)
        x = hidden.index_select(0, pair_tokens[start:end])  # each pair's token row, grouped by expert
        if start == end:  # no pair routed to this rank's experts
            mine = hidden.new_empty(0, hidden.shape[1])
        elif self.grouped is not None:
            local_offsets = offsets[low : high + 1] - start if start else offsets[low : high + 1]
            mine = self.grouped(x, [e - self.first for e in chosen[low:high]], local_offsets, self.act_fn)
            mine = mine * pair_weights[start:end]
        else:
            mine = torch.empty_like(x)  # each pair's weighted output, in the same order
            groups = zip(chosen[low:high], bounds[low:high], bounds[low + 1 : high + 1], strict=True)
            for expert, first, last in groups:
                mlp = self.expert_mlps[expert - self.first]
                rows = slice(first - start, last - start)
                mine[rows] = mlp.down_proj(self.act_fn(mlp.gate_up_proj(x[rows]))) * pair_weights[first:last]
        if end - start == len(pair_tokens):
            y = mine
        else:  # another rank's pairs count 0 here (a sum of zeros and this rank's: exact)
            y = hidden.new_zeros(len(pair_tokens), hidden.shape[1])
            y[start:end] = mine
        return y.index_select(0, where).view(num_tokens, top_k, -1).sum(dim=1)


def align_pairs(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's (token, expert) pairs, flattened token by token, sorted by expert (stably: a
    group's pairs stay in token order). Returns (the experts chosen, ascending; offsets [G + 1] of
    their groups; each grouped pair's token; its weight [pairs, 1]; where each token's pairs went,
    ascending, that is in expert order). cpu_ops.moe_align gives the same in one pass."""
    top_k = topk_ids.shape[1]
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = F.pad(counts.cumsum(0), (1, 0))
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel(), device=order.device)
    where = where.view(-1, top_k).sort(dim=1).values.flatten()
    return experts, offsets, order // top_k, topk_weights.flatten()[order].unsqueeze(1), where


class GroupedExperts:
    """Every expert's packed gate_up and down weights, computed a step at a time by the grouped
    integer kernel (cpu_ops.moe_quant_linear): one call per projection for all the step's experts,
    each weight read once, the experts' tasks shared by the threads in one parallel region."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], stream_ahead: int) -> None:
        self.gate_up, self.down, self.stream_ahead = gate_up, down, stream_ahead

    def __call__(
        self, x: torch.Tensor, experts: list[int], offsets: torch.Tensor, act_fn: nn.Module
    ) -> torch.Tensor:
        """x: the pairs' rows grouped by expert, rows offsets[g] .. offsets[g + 1] for experts[g]
        -> each row's expert output, unweighted."""
        gate_up = cpu_ops.moe_quant_linear(x, [self.gate_up[e] for e in experts], offsets, self.stream_ahead)
        return cpu_ops.moe_quant_linear(
            act_fn(gate_up), [self.down[e] for e in experts], offsets, self.stream_ahead
        )
