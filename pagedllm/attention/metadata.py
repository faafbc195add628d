"""AttentionMetadata: where each token of a step writes its K/V, and what each query reads.

Built once per step from the scheduled requests and shared by every layer.

Slots: the KV cache of a layer is [num_blocks, block_size, num_kv_heads, head_dim]; seen
flat it is [num_blocks * block_size, num_kv_heads, head_dim], and token position p of a
request lives in slot  block_table[p // block_size] * block_size + p % block_size.

    block_table = [7, 2, 9]           block_size = 4, seq_len = 10
    positions     0 1 2 3 | 4 5 6 7 | 8 9
    slots        28..31   |  8..11   | 36 37
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    prefill spans of the PyTorch path."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    decode_batches: list[DecodeBatch]
    prefills: list[PrefillSpan]
    kernel: PagedKernelInput | None = None
