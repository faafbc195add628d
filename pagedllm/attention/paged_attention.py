"""Attention over the paged KV cache in PyTorch ops, on any device (TorchBackend's path; on CPU
the C++ kernel serves instead where it is built: backend.py).

Every layer first writes the step's new K/V into their slots (write_kv, which the CPU kernel
path also uses for an 8-bit cache), then reads:
- decodes batched: the blocks of all decoding requests are gathered in one index_select
  ([batch, max_blocks * block_size, kv_heads, head_dim]) and attended in one SDPA call,
  padding masked out. The q heads that share a KV head are laid out as that head's query
  rows ([batch, kv_heads, group, head_dim]), which is exact for a single query position
  and avoids expanding K/V for grouped-query attention.
- prefills: one SDPA call per request chunk: causal over its own tokens, plus the
  context already in the cache (earlier chunks or prefix-cache hits) when there is one.
- a sliding-window layer (`window`): each query sees its last `window` keys only, its own
  included; the step's masks are narrowed for that layer.

An 8-bit cache (kv_quant.py) is quantized on write and dequantized where blocks are gathered;
its byte moves go through uint8 views, since not every device copies float8 by index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_quant import dequantize, is_quantized, quantize
from pagedllm.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSpan


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value: [num_tokens, num_kv_heads, head_dim] into their slots of the caches.
    Returns the rows as written (packed uint8 rows for an 8-bit cache)."""
    if is_quantized(k_cache):
        key, value = quantize(key, k_cache.dtype), quantize(value, v_cache.dtype)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    num_kv_heads, row = key.shape[1], k_cache.shape[-1]  # row: head_dim, + scale bytes when quantized
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, value)
    return key, value


def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[len(block_ids), block_size, num_kv_heads, head_dim] of those blocks, in `dtype`."""
    if is_quantized(cache):
        return dequantize(cache.view(torch.uint8).index_select(0, block_ids), cache.dtype, dtype)
    return cache.index_select(0, block_ids).to(dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]."""
    key_rows, value_rows = write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
    if is_quantized(k_cache) and metadata.prefills:
        # Attention sees K/V only as the cache holds them, so a prompt scores the same in one
        # chunk, in several, or after a prefix-cache hit (the last two read the cache anyway).
        key = dequantize(key_rows, k_cache.dtype, query.dtype)
        value = dequantize(value_rows, v_cache.dtype, query.dtype)
    output = torch.empty_like(query)
    for batch in metadata.decode_batches:
        output[batch.token_indices] = decode_gathered(
            query[batch.token_indices], k_cache, v_cache, batch, scale, window
        )
    for span in metadata.prefills:
        rows = slice(span.token_start, span.token_end)
        output[rows] = prefill_gathered(
            query[rows], key[rows], value[rows], k_cache, v_cache, span, scale, window
        )
    return output


def decode_gathered(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention in PyTorch ops, on any device: gather the blocks, then one SDPA call.
    query: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    flat_blocks = batch.block_tables.flatten()
    # [batch, max_blocks * block_size, kv_heads, head_dim]; SDPA gets a transposed, strided view
    keys = read_blocks(k_cache, flat_blocks, query.dtype).view(num_seqs, -1, num_kv_heads, head_dim)
    values = read_blocks(v_cache, flat_blocks, query.dtype).view(num_seqs, -1, num_kv_heads, head_dim)
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = batch.attend_mask
    if window is not None:  # a query at position seq_len - 1 sees keys from seq_len - window on
        key_positions = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (key_positions >= (batch.seq_lens - window).view(-1, 1, 1, 1))
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_gathered(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2], query.shape[2]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, chunk, head_dim]
    if window is not None:
        mask = _window_mask(span.num_context_tokens, query.shape[0], window, query.dtype, query.device)
    if span.block_ids is None:
        k = key.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, chunk, head_dim]
        v = value.transpose(0, 1).unsqueeze(0)
        if window is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        seq_len = span.num_context_tokens + query.shape[0]
        k = read_blocks(k_cache, span.block_ids, query.dtype).view(-1, num_kv_heads, head_dim)[:seq_len]
        v = read_blocks(v_cache, span.block_ids, query.dtype).view(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, seq_len, head_dim]
        v = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=span.attend_mask if window is None else mask, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)  # [chunk, num_heads, head_dim]


def _window_mask(
    num_context: int, chunk: int, window: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[chunk, num_context + chunk], additive: query position p sees keys p - window < k <= p."""
    query_positions = torch.arange(num_context, num_context + chunk, device=device)[:, None]
    key_positions = torch.arange(num_context + chunk, device=device)[None, :]
    visible = (key_positions <= query_positions) & (key_positions > query_positions - window)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
