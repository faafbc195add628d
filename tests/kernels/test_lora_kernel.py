"""cpu_ops.lora_add_ (csrc/lora_cpu.cpp) against the same sums written out in float64: any step's
groups of rows, adapters of any rank up to the slots' largest, fused projections of several parts
and widths that do not fill a block (hypothesis), in float32 and bfloat16; bad input refused with
a readable error, not read out of bounds."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kernels import cpu_ops

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Relative to the largest delta: float32 sums in another order; bfloat16 rounds out once."""


@st.composite
def steps(draw):
    slots, max_rank = draw(st.integers(1, 4)), draw(st.sampled_from([1, 4, 8, 16, 20]))
    parts = draw(st.lists(st.integers(1, 70), min_size=1, max_size=3))
    rows, width = draw(st.integers(1, 12)), draw(st.integers(1, 90))
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=0, max_size=4)))
    bounds = [0, *cuts, rows]
    groups = [(draw(st.integers(0, slots - 1)), a, b) for a, b in itertools.pairwise(bounds) if b > a]
    ranks = [draw(st.integers(0, max_rank)) for _ in range(slots)]
    return slots, max_rank, parts, rows, width, groups, ranks


def reference(out, x, a, b_t, groups, ranks, offsets, max_rank):
    out = out.double().clone()
    for slot, first, end in groups:
        rank = ranks[slot]
        for part in range(len(offsets) - 1):
            shrunk = x[first:end].double() @ a[slot, part * max_rank : part * max_rank + rank].double().t()
            columns = slice(offsets[part], offsets[part + 1])
            out[first:end, columns] += shrunk @ b_t[slot, :rank, columns].double()
    return out


@settings(max_examples=120, deadline=None)
@given(steps(), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**31))
def test_lora_add_is_the_sum_written_out(step, dtype, seed):
    assert cpu_ops.is_built()
    slots, max_rank, parts, rows, width, groups, ranks = step
    generator = torch.Generator().manual_seed(seed)
    offsets = [sum(parts[:i]) for i in range(len(parts) + 1)]
    out = torch.randn(rows, offsets[-1], generator=generator).to(dtype)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    a = torch.randn(slots, len(parts) * max_rank, width, generator=generator).to(dtype)
    b_t = torch.randn(slots, max_rank, offsets[-1], generator=generator).to(dtype)
    expected = reference(out, x, a, b_t, groups, ranks, offsets, max_rank)
    ours = cpu_ops.lora_add_(
        out.clone(),
        x,
        a,
        cpu_ops.lora_output_blocks(b_t, offsets),
        torch.tensor(groups, dtype=torch.long).reshape(-1, 3),
        torch.tensor(ranks, dtype=torch.long),
        torch.tensor(offsets, dtype=torch.long),
    )
    scale = max(1.0, float((expected - out.double()).abs().max()))
    assert float((ours.double() - expected).abs().max()) <= TOLERANCE[dtype] * scale


def test_bad_input_is_refused_by_name():
    out, x = torch.zeros(4, 8), torch.zeros(4, 6)
    a, b = torch.zeros(2, 3, 6), cpu_ops.lora_output_blocks(torch.zeros(2, 3, 8), [0, 8])
    offsets, ranks = torch.tensor([0, 8]), torch.tensor([3, 3])

    def call(groups, ranks=ranks, offsets=offsets, out=out, b=b):
        return cpu_ops.lora_add_(
            out, x, a, b, torch.tensor(groups, dtype=torch.long).reshape(-1, 3), ranks, offsets
        )

    with pytest.raises(RuntimeError, match="outside 2 slots and 4 rows"):
        call([(2, 0, 1)])
    with pytest.raises(RuntimeError, match="outside 2 slots and 4 rows"):
        call([(0, 3, 9)])
    with pytest.raises(RuntimeError, match="rank 4 is outside"):
        call([(0, 0, 1)], ranks=torch.tensor([4, 3]))
    with pytest.raises(RuntimeError, match="part_offsets must run from 0 to 8"):
        call([(0, 0, 1)], offsets=torch.tensor([0, 7]))
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        call([(0, 0, 1)], out=out.bfloat16())
    with pytest.raises(RuntimeError, match="b has 2 blocks a slot; the parts take 1"):
        call([(0, 0, 1)], b=torch.zeros(2, 2, 3, 32))
    with pytest.raises(RuntimeError, match="b must be"):
        call([(0, 0, 1)], b=torch.zeros(2, 3, 8))
    assert torch.equal(call([]), out)
