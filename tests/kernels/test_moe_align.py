"""cpu_ops.moe_align (csrc/moe_align_cpu.cpp) against layers/fused_moe.align_pairs, the same
grouping in PyTorch's ops: equal outputs for any step's expert choices (hypothesis), and bad
input refused with a readable error, not read out of bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kernels import cpu_ops
from pagedllm.layers.fused_moe import align_pairs


@st.composite
def choices(draw):
    """(topk_ids [tokens, top_k], num_experts): each token's top_k distinct experts, as topk gives."""
    num_experts = draw(st.integers(1, 40))
    top_k = draw(st.integers(1, num_experts))
    tokens = draw(st.integers(0, 12))
    rows = [draw(st.permutations(range(num_experts)))[:top_k] for _ in range(tokens)]
    return torch.tensor(rows, dtype=torch.long).view(tokens, top_k), num_experts


@settings(max_examples=150, deadline=None)
@given(choices(), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**31))
def test_moe_align_is_align_pairs(choice, dtype, seed):
    assert cpu_ops.is_built()  # CI machines have a compiler: a failed build must not pass silently
    topk_ids, num_experts = choice
    weights = torch.rand(topk_ids.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ours = cpu_ops.moe_align(topk_ids, weights, num_experts)
    reference = align_pairs(topk_ids, weights, num_experts)
    for name, a, b in zip(
        ["experts", "offsets", "pair_tokens", "pair_weights", "where"], ours, reference, strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_token_choosing_one_expert_twice_groups_both_pairs():
    ids, weights = torch.tensor([[2, 2], [0, 2]]), torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    for a, b in zip(cpu_ops.moe_align(ids, weights, 3), align_pairs(ids, weights, 3), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("ids", "weights", "num_experts", "message"),
    [
        (torch.tensor([[0, 7]]), torch.ones(1, 2), 4, "expert id 7 is not in 0..3"),
        (torch.tensor([[0, -1]]), torch.ones(1, 2), 4, "expert id -1 is not in 0..3"),
        (torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2), 4, "topk_ids must be int64"),
        (torch.tensor([0, 1]), torch.ones(2), 4, "topk_ids must be int64 \\[tokens, top_k\\]"),
        (torch.tensor([[0, 1]]), torch.ones(1, 3), 4, "topk_weights must be float of topk_ids' shape"),
        (torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.long), 4, "topk_weights must be float"),
        (torch.tensor([[0, 1]]), torch.ones(1, 2), 0, "num_experts must be 1"),
    ],
)
def test_bad_input_is_refused(ids, weights, num_experts, message):
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.moe_align(ids, weights, num_experts)
