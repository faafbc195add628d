"""AttentionMetadata: where each token of a step writes its K/V, and what each query reads.

Built once per step from the scheduled requests (by the attention backend) and shared by every
layer.

Slots: the KV cache of a layer is [num_blocks, block_size, num_kv_heads, head_dim]; seen
flat it is [num_blocks * block_size, num_kv_heads, head_dim], and token position p of a
request lives in slot  block_table[p // block_size] * block_size + p % block_size.

    block_table = [7, 2, 9]           block_size = 4, seq_len = 10
    positions     0 1 2 3 | 4 5 6 7 | 8 9
    slots        28..31   |  8..11   | 36 37
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RunsAttention(Protocol):
    """What `AttentionMetadata.backend` holds (backend.py's AttentionBackend), as a protocol: the
    backend builds this metadata, so importing it here would close a circle."""

    def forward(
        self, layer: Any, qkv: torch.Tensor, rope: Any, kv_cache: Any, metadata: AttentionMetadata
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepLayout:
    """Where a step's tokens lie, as the runner laid them out: request i computes counts[i]
    tokens at flat rows row_offsets[i].., after starts[i] tokens already in the cache, and
    attends seq_lens[i] = starts[i] + counts[i] keys once they are written."""

    slot_mapping: torch.Tensor  # [num_tokens], on the host
    counts: list[int]
    starts: list[int]
    seq_lens: list[int]
    row_offsets: list[int]
    block_tables: torch.Tensor  # [num_reqs, >= the most blocks any request uses]
    block_size: int


@dataclass
class DecodeBatch:
    """Requests computing one token each, attended in one batched call."""

    token_indices: torch.Tensor  # [batch] rows of these tokens in the step's flat layout
    block_tables: torch.Tensor  # [batch, max_blocks] (padding points at block 0, masked out)
    seq_lens: torch.Tensor  # [batch] keys each request attends (its new token included)
    attend_mask: torch.Tensor  # [batch, 1, 1, max_blocks * block_size] True where a key is valid


@dataclass
class PrefillSpan:
    """One request computing several tokens (a prompt or a chunk of it)."""

    token_start: int  # its rows in the step's flat layout: [token_start, token_end)
    token_end: int
    num_context_tokens: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # [num_blocks] to read the context; None without context
    attend_mask: torch.Tensor | None  # [chunk, context + chunk] causal with context: 0 or -inf


@dataclass
class PagedKernelInput:
    """What the CPU kernel reads: every request's block table and where its tokens lie."""

    block_tables: torch.Tensor  # [num_reqs, max_blocks]
    query_start_loc: torch.Tensor  # [num_reqs + 1] request i's tokens are rows [start[i], start[i + 1])
    seq_lens: torch.Tensor  # [num_reqs] keys of each request once this step's K/V is written


@dataclass
class AttentionMetadata:
    """Either `kernel` (the CPU kernel takes every token at once), or the decode batches and
    prefill spans of the PyTorch path; `backend` runs the path it was built for."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    decode_batches: list[DecodeBatch]
    prefills: list[PrefillSpan]
    kernel: PagedKernelInput | None = None
    backend: RunsAttention | None = None  # None: built by hand (tests) for paged_attention()


def build_torch_metadata(layout: StepLayout, device: torch.device, dtype: torch.dtype) -> AttentionMetadata:
    """Decode batches grouped by length and one span per prefill chunk, for the PyTorch path.
    dtype: the model's, for the additive masks."""
    counts = layout.counts
    decode_reqs = [i for i in range(len(counts)) if counts[i] == 1]
    decode_batches = [
        _decode_batch(group, layout, device) for group in _group_by_length(decode_reqs, layout.seq_lens)
    ]
    prefills = [_prefill_span(i, layout, device, dtype) for i in range(len(counts)) if counts[i] > 1]
    return AttentionMetadata(layout.slot_mapping.to(device), decode_batches, prefills)


# Decodes are grouped by context length so one long request does not make every short one
# pay its padding: a group ends where the next context is over twice the group's shortest,
# so padding never doubles the keys a group reads (a few such groups beat one padded call:
# docs/benchmarks/kernels_and_dispatch.md, "Figures behind choices in the code").
def _group_by_length(req_indices: list[int], seq_lens: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in sorted(req_indices, key=seq_lens.__getitem__):
        if groups and seq_lens[i] <= 2 * seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_batch(group: list[int], layout: StepLayout, device: torch.device) -> DecodeBatch:
    group_seq_lens = torch.tensor([layout.seq_lens[i] for i in group])
    num_blocks = -(-int(group_seq_lens.max()) // layout.block_size)
    tables = layout.block_tables[torch.tensor(group), :num_blocks]
    key_positions = torch.arange(num_blocks * layout.block_size)
    mask = (key_positions[None, :] < group_seq_lens[:, None])[:, None, None, :]
    return DecodeBatch(
        token_indices=torch.tensor([layout.row_offsets[i] for i in group], dtype=torch.long).to(device),
        block_tables=tables.to(device),
        seq_lens=group_seq_lens.to(device),
        attend_mask=mask.to(device),
    )


def _prefill_span(req: int, layout: StepLayout, device: torch.device, dtype: torch.dtype) -> PrefillSpan:
    row_offset, count, start = layout.row_offsets[req], layout.counts[req], layout.starts[req]
    if start == 0:
        return PrefillSpan(row_offset, row_offset + count, 0, None, None)
    seq_len = start + count
    num_blocks = -(-seq_len // layout.block_size)
    query_positions = torch.arange(start, seq_len)
    visible = torch.arange(seq_len)[None, :] <= query_positions[:, None]  # [chunk, seq_len]
    # additive, in the model's dtype: SDPA adds it as it is, where a boolean mask would be
    # converted again in every layer
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    block_ids = layout.block_tables[req, :num_blocks].to(device)
    return PrefillSpan(row_offset, row_offset + count, start, block_ids, mask.to(device))
