"""Attention over the paged KV cache, in plain PyTorch.

Every layer first writes the step's new K/V into their slots, then reads:
- decodes, batched: the blocks of all decoding requests are gathered in one index_select
  ([batch, max_blocks * block_size, kv_heads, head_dim]) and attended in one SDPA call,
  padding masked out. The q heads that share a KV head are laid out as that head's query
  rows ([batch, kv_heads, group, head_dim]), which is exact for a single query position
  and avoids expanding K/V for grouped-query attention.
- prefills, one SDPA call per request chunk: causal over its own tokens, plus the context
  already in the cache (earlier chunks or prefix-cache hits) when there is one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSpan


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] into their slots of the caches."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]."""
    write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
    output = torch.empty_like(query)
    for batch in metadata.decode_batches:
        output[batch.token_indices] = _decode(query[batch.token_indices], k_cache, v_cache, batch, scale)
    for span in metadata.prefills:
        rows = slice(span.token_start, span.token_end)
        output[rows] = _prefill(query[rows], key[rows], value[rows], k_cache, v_cache, span, scale)
    return output


def _decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    flat_blocks = batch.block_tables.flatten()
    # [batch, kv_heads, max_blocks * block_size, head_dim], a strided view of the gathered blocks
    keys = k_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys.to(query.dtype), values.to(query.dtype), attn_mask=batch.attend_mask, scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, chunk, head_dim]
    if span.block_ids is None:
        k = key.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, chunk, head_dim]
        v = value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        seq_len = span.num_context_tokens + query.shape[0]
        k = k_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.to(query.dtype).transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, seq_len, head_dim]
        v = v.to(query.dtype).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=span.attend_mask, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)  # [chunk, num_heads, head_dim]
