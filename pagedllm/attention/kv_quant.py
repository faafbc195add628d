"""8-bit KV cache: K and V stored one byte per element, a float16 scale beside each row.

A quantized cache has the layout of an unquantized one, [num_blocks, block_size, num_kv_heads, row],
but each (token, KV head) row packs head_dim 8-bit values followed by the two bytes of its scale:

    row = [ q_0  q_1  ...  q_{head_dim-1} | scale ]       x_i ~= q_i * scale
            head_dim x int8 / fp8           float16 (2 bytes)

Why per token and KV head, in float16, packed into the row:
- A token's K/V are written once, when it is computed, and never rewritten; a scale of its own
  needs no statistics of other tokens and no re-quantization when a block fills up.
- The slot holds everything needed to read the token back, so block tables, slot mapping, prefix
  caching (blocks shared by hash) and preemption (blocks freed and recomputed) are unchanged, and
  one index_select gathers values and scales together.
- float16 costs 2 bytes a row: (64 + 2) / 128 of a bfloat16 cache's bytes, 1.94x the tokens for
  head_dim 64; a float32 scale per token and head would give 1.88x.

The scale is amax / qmax, rounded up to float16 and kept at least float16's smallest normal
number, so no element is clipped and the scale keeps float16's full precision.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""Quantized cache dtypes by their --kv-cache-dtype name (`fp8` is an alias of `fp8_e4m3`)."""

SCALE_BYTES = 2  # one float16 per (token, KV head) row

_QMAX = {
    torch.int8: 127.0,  # symmetric: -128 is never used, so q and -q are both representable
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,  # 448
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,  # 57344
}
_MIN_SCALE = torch.finfo(torch.float16).smallest_normal  # 2^-14: below it float16 loses precision
_MAX_SCALE = torch.finfo(torch.float16).max
_ROUND_UP = 1 + 2**-10  # float16 rounds by at most 2^-11 relative, so the scale never comes out low


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _QMAX


def quantize(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Pack rows for a cache of dtype `fmt`.

    Args:
        x: [..., head_dim] float K or V.
        fmt: torch.int8, torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        [..., head_dim + SCALE_BYTES] uint8: each row's values in `fmt`, then its scale's bytes.
    """
    qmax = _QMAX[fmt]
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [..., 1]
    scale = (amax * (_ROUND_UP / qmax)).clamp_(_MIN_SCALE, _MAX_SCALE).to(torch.float16)
    # In range by construction; the clamp guards rows past float16's max scale (and e4m3's NaN on overflow)
    q = (x.float() / scale.float()).clamp_(-qmax, qmax)
    q = q.round_().to(fmt) if fmt == torch.int8 else q.to(fmt)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(packed: torch.Tensor, fmt: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + SCALE_BYTES] uint8 rows of a `fmt` cache -> [..., head_dim] in `dtype`."""
    data = packed[..., :-SCALE_BYTES].view(fmt)
    scale = packed[..., -SCALE_BYTES:].view(torch.float16).to(dtype)  # [..., 1]
    # Convert, then scale in place: on CPU faster than one promoting int8 x float multiply.
    return data.to(dtype).mul_(scale)
