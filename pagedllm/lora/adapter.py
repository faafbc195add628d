"""Adapter: one LoRA adapter's weights, read and checked, ready to be placed in the layers' slots.

A projection W (out x in) under an adapter computes x Wᵀ + s · (x Aᵀ) Bᵀ, A of r x in, B of out x r,
s its scaling (lora_alpha / r, or / sqrt(r) for rsLoRA). The scaling is folded into B once here.

An adapter file is untrusted input, read from a path a client may name (POST
/v1/load_lora_adapter): every check happens here, at load, so a bad adapter is one clear error
and never a failure at the first request that uses it: a projection this model lacks or this
server cannot change, a rank over --max-lora-rank, sizes of another base model, values that are
not finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.targets import SUPPORTED, LoRATarget


class LoRAError(ValueError):
    """An adapter that cannot be served; the message says which and why."""


@dataclass(frozen=True)
class LoRAPart:
    """One projection's low-rank pair as its file holds it."""

    a: torch.Tensor
    """[rank, in_features]."""
    b: torch.Tensor
    """[out_features, rank]."""
    scaling: float


@dataclass(frozen=True)
class Adapter:
    name: str
    adapter_id: int
    rank: int
    """The largest rank of its projections."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Target name (layers.3.self_attn.q_proj) -> (A [r, in], B · scaling [out, r]), in the
    model's dtype."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def build_adapter(
    name: str,
    adapter_id: int,
    source: str,
    parts: dict[str, LoRAPart],
    targets: dict[str, LoRATarget],
    max_rank: int,
    dtype: torch.dtype,
) -> Adapter:
    """The adapter of `parts` (target name -> its pair), each checked against this model's
    `targets`. Raises LoRAError naming `source` and the first projection at fault."""
    if not parts:
        raise LoRAError(f"{source}: holds no LoRA weights")
    weights = {}
    for target_name, part in sorted(parts.items()):
        target = targets.get(target_name)
        if target is None:
            projection = target_name.rsplit(".", 1)[-1]
            why = (
                f"{projection} is not a projection LoRA can change here (supported: {', '.join(SUPPORTED)})"
                if projection not in SUPPORTED
                else "this model has no such projection (past its last layer, or an MLP of experts)"
            )
            raise LoRAError(f"{source}: {target_name}: {why}")
        rank = part.a.shape[0] if part.a.dim() == 2 else -1
        if part.a.dim() != 2 or part.b.dim() != 2 or part.b.shape[1] != rank or rank < 1:
            raise LoRAError(
                f"{source}: {target_name}: lora_A {tuple(part.a.shape)} and lora_B {tuple(part.b.shape)} "
                "are not a low-rank pair ([r, in] and [out, r])"
            )
        if rank > max_rank:
            raise LoRAError(f"{source}: {target_name}: rank {rank} is over --max-lora-rank {max_rank}")
        if part.a.shape[1] != target.in_features or part.b.shape[0] != target.out_features:
            raise LoRAError(
                f"{source}: {target_name}: lora_A {tuple(part.a.shape)} and lora_B {tuple(part.b.shape)} "
                f"do not fit this model's projection ({target.out_features} x {target.in_features}): "
                "an adapter of another base model?"
            )
        a, b = part.a.float(), part.b.float() * part.scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{source}: {target_name}: holds values that are not finite")
        weights[target_name] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return Adapter(name, adapter_id, rank, weights)
