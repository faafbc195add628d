"""LoRALinear: a projection whose output gets, per group of rows, its adapter's low-rank product.

    out = x Wᵀ                               the base projection, its weights as held (quantized or float)
    for each group (slot, rows start..end):  out[rows] += (x[rows] A_slotᵀ) B_slotᵀ   (B holds the scaling)

Each layer holds `max_loras` slots of A and B (an adapter placed in a slot is copied into every
layer's); a step's rows are ordered by adapter, so each group is a run of rows and costs one
shrink (x Aᵀ, r columns a part) and one expand per part of a fused projection (q, k, v; gate, up):
punica's shrink and expand, as two small matrix products per group on CPU. Rows of the base
model are in no group.

Tensor parallelism: a column-parallel projection holds this rank's rows of B (its output rows), a
row-parallel one this rank's columns of A (its input columns); since (x_r A_rᵀ) Bᵀ summed over the
ranks is (x Aᵀ) Bᵀ, each rank adds its part before the all-reduce the base projection makes anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.host_pages import fresh_pages
from pagedllm.kernels import cpu_ops
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear


@dataclass
class LoRAMapping:
    """This step's groups of rows, shared by every LoRALinear: (slot, first row, end row), and
    the same as an int64 tensor [groups, 3] for the CPU kernel."""

    groups: list[tuple[int, int, int]] = field(default_factory=list)
    groups_tensor: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.long))

    def set(self, groups: list[tuple[int, int, int]]) -> None:
        self.groups = groups
        self.groups_tensor = torch.tensor(groups, dtype=torch.long).reshape(-1, 3)


class LoRALinear(DirectCall, nn.Module):
    def __init__(
        self,
        base: Linear,
        part_sizes: list[int],
        max_rank: int,
        slots: tuple[torch.Tensor, torch.Tensor],
        mapping: LoRAMapping,
    ) -> None:
        """`part_sizes`: this rank's output rows of each checkpoint projection fused in `base`;
        `slots`: zeroed A and B of slot_shapes' shapes, in the activations' dtype."""
        super().__init__()
        self.base = base
        self.mapping = mapping
        self.max_rank = max_rank
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes) + 1)]
        self.lora_a, self.lora_b = slots
        """A of each slot; Bᵀ of each slot in the kernel's blocks of outputs (cpu_ops.lora_output_blocks)."""
        max_loras, dtype = self.lora_a.shape[0], self.lora_a.dtype
        self.ranks = [0] * max_loras
        """The rank each slot computes with here (0: its adapter leaves this projection alone)."""
        self.ranks_tensor = torch.zeros(max_loras, dtype=torch.long)
        self.offsets_tensor = torch.tensor(self.part_offsets, dtype=torch.long)
        self.in_kernel = cpu_ops.serves_layer_ops(base.weight.device, dtype) and dtype != torch.float16
        """Every group in one call of the CPU kernel (cpu_ops.lora_add_), else a product pair each."""
        self.tp = getattr(base, "tp", None)
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.reduce = self.row_parallel and self.tp is not None and base.reduce_results

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Place an adapter's pairs (A [r, in], B [out, r] whole, per part; None for a part it
        leaves alone) in `slot`, this rank's share of each."""
        self.lora_a[slot].zero_()
        b_t = torch.zeros(self.lora_b.shape[2], self.part_offsets[-1], dtype=self.lora_b.dtype)
        rank = max((a.shape[0] for a, _ in filter(None, parts)), default=0)
        for index, pair in enumerate(parts):
            if pair is None:
                continue
            a, b = pair
            if self.tp is not None and self.row_parallel:
                width = self.base.in_features
                a = a[:, self.tp.rank * width : (self.tp.rank + 1) * width]
            elif self.tp is not None:
                size = self.part_offsets[index + 1] - self.part_offsets[index]
                b = b[self.tp.rank * size : (self.tp.rank + 1) * size]
            first = index * self.max_rank
            self.lora_a[slot, first : first + a.shape[0]] = a
            b_t[: b.shape[1], self.part_offsets[index] : self.part_offsets[index + 1]] = b.t()
        self.lora_b[slot] = cpu_ops.lora_output_blocks(b_t, self.part_offsets)
        self.ranks[slot] = rank
        self.ranks_tensor[slot] = rank

    def clear_slot(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.ranks_tensor[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, mapping = self.base, self.mapping
        out = base.impl(x, base.weight, base.bias)
        if not mapping.groups:
            pass
        elif self.in_kernel:
            cpu_ops.lora_add_(
                out,
                x.contiguous(),
                self.lora_a,
                self.lora_b,
                mapping.groups_tensor,
                self.ranks_tensor,
                self.offsets_tensor,
            )
        else:
            for slot, start, end in mapping.groups:
                rank = self.ranks[slot]
                if rank:
                    self._add(out[start:end], x[start:end], slot, rank)
        return self.tp.all_reduce(out) if self.reduce and self.tp is not None else out

    def _add(self, out: torch.Tensor, x: torch.Tensor, slot: int, rank: int) -> None:
        shrunk = x @ self.lora_a[slot].t()  # [rows, parts * max_rank]
        offsets, blocks = self.part_offsets, self.lora_b[slot]  # [blocks, max_rank, 32]
        first_block = 0
        for index in range(len(offsets) - 1):
            size = offsets[index + 1] - offsets[index]
            count = -(-size // cpu_ops.LORA_OUTPUT_BLOCK)
            part = blocks[first_block : first_block + count, :rank].transpose(0, 1).flatten(1)[:, :size]
            first = index * self.max_rank
            out[:, offsets[index] : offsets[index + 1]].addmm_(shrunk[:, first : first + rank], part)
            first_block += count


def add_lora_layers(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, mapping: LoRAMapping
) -> dict[str, LoRALinear]:
    """Put a LoRALinear around every projection an adapter may change (attention's qkv and o, a
    dense MLP's gate_up and down); returns them by module path (layers.3.self_attn.qkv_proj)."""
    wrapping = []
    layers: nn.ModuleList = model.layers  # type: ignore[assignment]
    for index, layer in enumerate(layers):
        owners = [("self_attn", layer.self_attn, ("qkv_proj", "o_proj"))]
        if isinstance(getattr(layer.mlp, "gate_up_proj", None), Linear):
            owners.append(("mlp", layer.mlp, ("gate_up_proj", "down_proj")))
        for block, owner, names in owners:
            for name in names:
                base = getattr(owner, name)
                sizes = (
                    base.output_sizes if isinstance(base, MergedColumnParallelLinear) else [base.out_features]
                )
                wrapping.append((f"layers.{index}.{block}.{name}", owner, name, base, sizes))
    shapes = [slot_shapes(base.in_features, sizes, max_loras, max_rank) for *_, base, sizes in wrapping]
    storage = _slot_storage(shapes, dtype)
    wrapped = {}
    for (path, owner, name, base, sizes), slots in zip(wrapping, storage, strict=True):
        lora = LoRALinear(base, sizes, max_rank, slots, mapping)
        setattr(owner, name, lora)
        wrapped[path] = lora
    return wrapped


def slot_shapes(
    in_features: int, part_sizes: list[int], max_loras: int, max_rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a LoRALinear's A (every part's r rows of each slot) and B (in the kernel's
    blocks of outputs)."""
    blocks = sum(-(-size // cpu_ops.LORA_OUTPUT_BLOCK) for size in part_sizes)
    return (max_loras, len(part_sizes) * max_rank, in_features), (
        max_loras,
        blocks,
        max_rank,
        cpu_ops.LORA_OUTPUT_BLOCK,
    )


def _slot_storage(
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed A and B of every layer, in one mapping on 2 MiB pages: a step reads a few KB of
    every layer's slots, from all over them, and on 4 KiB pages each read would wait on an
    address translation the weights streamed through before have evicted."""
    item = torch.empty((), dtype=dtype).element_size()

    def aligned(shape: tuple[int, ...]) -> int:  # each tensor from a 64-byte boundary
        return -(-math.prod(shape) * item // 64) * 64

    buffer = fresh_pages(sum(aligned(shape) for pair in shapes for shape in pair))
    views, offset = [], 0
    for pair in shapes:
        tensors = []
        for shape in pair:
            tensors.append(buffer[offset : offset + math.prod(shape) * item].view(dtype).view(shape))
            offset += aligned(shape)
        views.append((tensors[0], tensors[1]))
    return views
