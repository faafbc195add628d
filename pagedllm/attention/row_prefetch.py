"""Where the paged attention kernel prefetches the cache rows it reads, into L1 or into L2, chosen
by timing both on this host, once per process and model shape.

A step reads each request's keys and values from blocks scattered over the cache, one KV head's
row every num_kv_heads rows, so the hardware cannot guess them: the kernel asks for each row a
fixed number of rows ahead. Asking into L1 (prefetcht0) or into L2 (prefetcht1) moves a decode's
time a lot and not the same way everywhere (the quantized kernel's own prefetch went opposite
ways on two hosts of one kind), so both are timed here on a decode-shaped call over a cache twice
the size of the last-level cache (256 MiB at most), in turn for a few rounds, and the faster
serves every call. The results are the same either way (a test).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from pagedllm.attention.kv_quant import KV_CACHE_DTYPES, SCALE_BYTES
from pagedllm.cpu_features import last_level_cache_bytes
from pagedllm.kernels import cpu_ops

logger = logging.getLogger(__name__)

TIMED_KV_HEADS, TIMED_QUERIES_PER_KV_HEAD, TIMED_BLOCK_SIZE = 8, 4, 16
"""The timed decode's shape (a 1-8B model's grouped heads; the server's default block size)."""
TIMED_REQUESTS, TIMED_KEYS = 4, 1024
"""Each timed call: 4 requests of 1,024 keys."""
ROUNDS = 5
MAX_TIMED_CACHE_BYTES = 256 * 1024**2


def faster_is_l2(seconds: dict[bool, list[float]]) -> bool:
    """Whether prefetching into L2 (key True) took less time than into L1 (False), each way's
    fastest round against the other's: a busy moment of the host slows one round, not a way."""
    return min(seconds[True]) < min(seconds[False])


@functools.cache
def prefetch_to_l2(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention should prefetch rows into L2 for a model of this dtype, cache
    dtype and head_dim on this host; timed the first time a process asks, then remembered."""
    if not cpu_ops.is_built():
        return False
    quantized = cache_dtype in KV_CACHE_DTYPES.values()
    row = head_dim + SCALE_BYTES if quantized else head_dim  # 8-bit rows end in their scale
    block_bytes = TIMED_BLOCK_SIZE * TIMED_KV_HEADS * row * torch.empty(0, dtype=cache_dtype).element_size()
    blocks_per_call = TIMED_REQUESTS * TIMED_KEYS // TIMED_BLOCK_SIZE
    cache_bytes = min(2 * last_level_cache_bytes(), MAX_TIMED_CACHE_BYTES)
    calls = max(2, -(-cache_bytes // (2 * block_bytes * blocks_per_call)))  # K and V
    shape = (calls * blocks_per_call, TIMED_BLOCK_SIZE, TIMED_KV_HEADS, row)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    order = torch.randperm(shape[0], generator=torch.Generator().manual_seed(0))
    tables = order.view(calls, TIMED_REQUESTS, -1)  # each call its own scattered blocks
    query = torch.zeros(TIMED_REQUESTS, TIMED_KV_HEADS * TIMED_QUERIES_PER_KV_HEAD, head_dim, dtype=dtype)
    starts = torch.arange(TIMED_REQUESTS + 1)
    lens = torch.full((TIMED_REQUESTS,), TIMED_KEYS)

    def one_pass(to_l2: bool) -> float:
        started = time.perf_counter()
        for call in range(calls):
            cpu_ops.paged_attention(query, k_cache, v_cache, tables[call], starts, lens, 1.0, to_l2)
        return time.perf_counter() - started

    one_pass(False), one_pass(True)  # warm-up
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for to_l2 in (False, True):
            seconds[to_l2].append(one_pass(to_l2))
    chosen = faster_is_l2(seconds)
    logger.info(
        "Paged attention prefetches cache rows into %s (a decode pass timed: into L1 %.2f ms, L2 %.2f ms)",
        "L2" if chosen else "L1",
        min(seconds[False]) * 1e3,
        min(seconds[True]) * 1e3,
    )
    return chosen
