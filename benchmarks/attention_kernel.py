"""The CPU paged-attention kernel against PyTorch's path (gather the blocks, then SDPA), in one run.

    .venv/bin/python benchmarks/attention_kernel.py                  # bfloat16 model and cache
    .venv/bin/python benchmarks/attention_kernel.py --dtype float32
    .venv/bin/python benchmarks/attention_kernel.py --shape llama-3.2-1b

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), block size 32, or
Llama-3.2-1B's (32 query heads, 8 KV heads, head_dim 64; block size 16, the server's default), or
Gemma-3-1B's (4 query heads, 1 KV head, head_dim 256: one decode is one task, so one thread),
and 30 layers' caches of which each call takes the next, so K/V come from memory as in a real step
rather than from a cache level a single repeated call would keep them in. Cases: decode steps
(32 and 8 requests, 300 or 1,000 keys each; 1 and 8 requests at 576 keys, 1 at 2,048: a served
512-token prompt's decode, and a longer one), fresh prompts (4 x 512 tokens) and prefill chunks
after a cached context (2 x 256 tokens after 768). Each request's blocks are scattered over the
cache. Prints microseconds per layer call with the kernel's cache rows prefetched into L1 and
into L2 (the engine times the two once per host: attention/row_prefetch.py), the faster one's
speed-up and, for decodes, the K/V bytes it reads per second; `--threads` sets torch's thread
count (default: all cores).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from pagedllm.attention.metadata import DecodeBatch, PrefillSpan
from pagedllm.attention.paged_attention import decode_gathered, prefill_gathered
from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.kernels import cpu_ops
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches

SHAPES = {  # name: (query heads, KV heads, head_dim, block size)
    "smollm2-135m": (9, 3, 64, 32),
    "llama-3.2-1b": (32, 8, 64, 16),
    "gemma-3-1b": (4, 1, 256, 16),
}
NUM_LAYERS = 30
CASES = {  # name: (requests, tokens each computes, keys each attends)
    "decode 32 x 300 keys": (32, 1, 300),
    "decode 32 x 1000 keys": (32, 1, 1000),
    "decode 8 x 300 keys": (8, 1, 300),
    "decode 1 x 576 keys": (1, 1, 576),
    "decode 8 x 576 keys": (8, 1, 576),
    "decode 1 x 2048 keys": (1, 1, 2048),
    "prompts 4 x 512": (4, 512, 512),
    "chunks 2 x 256 after 768": (2, 256, 1024),
}


def make_case(num_reqs: int, rows: int, seq_len: int, shape: str, num_blocks: int, dtype: torch.dtype, gen):
    num_heads, _, head_dim, block_size = SHAPES[shape]
    blocks_each = -(-seq_len // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: num_reqs * blocks_each].view(num_reqs, blocks_each)
    query = torch.randn(num_reqs * rows, num_heads, head_dim, generator=gen).to(dtype)
    return query, tables, torch.arange(num_reqs + 1) * rows, torch.full((num_reqs,), seq_len)


def kernel_path(k_cache, v_cache, query, tables, starts, seq_lens, scale, to_l2=False):
    return cpu_ops.paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, scale, to_l2)


def pytorch_path(k_cache, v_cache, query, tables, starts, seq_lens, scale):
    """What the engine runs without the kernel: gather + SDPA (decodes batched, prefills one by one)."""
    rows = int(starts[1] - starts[0])
    if rows == 1:
        key_positions = torch.arange(tables.shape[1] * k_cache.shape[1])  # blocks x block size
        mask = (key_positions[None, :] < seq_lens[:, None])[:, None, None, :]
        batch = DecodeBatch(torch.arange(len(seq_lens)), tables, seq_lens, mask)
        return decode_gathered(query, k_cache, v_cache, batch, scale)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = seq_len - rows
        visible = torch.arange(seq_len)[None, :] <= torch.arange(start, seq_len)[:, None]
        mask = torch.zeros(visible.shape, dtype=query.dtype).masked_fill_(~visible, float("-inf"))
        span = PrefillSpan(0, rows, start, tables[i], mask)
        chunk = slice(int(starts[i]), int(starts[i + 1]))
        out[chunk] = prefill_gathered(query[chunk], None, None, k_cache, v_cache, span, scale)
    return out


def time_per_call(fn, inputs: tuple, caches, repeats: int) -> float:
    for layer in range(NUM_LAYERS):  # warm up: every layer once
        fn(*caches[layer], *inputs)
    start = time.perf_counter()
    for i in range(repeats):
        fn(*caches[i % NUM_LAYERS], *inputs)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument(
        "--num-blocks", type=int, help="blocks per layer's cache (default: the cases' need + 10%%)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_ops.is_built():
        raise SystemExit("the CPU kernel could not be built here (no compiler?)")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    _, num_kv_heads, head_dim, block_size = SHAPES[args.shape]
    needed = max(reqs * -(-keys // block_size) for reqs, _, keys in CASES.values())
    num_blocks = args.num_blocks or needed * 11 // 10
    spec = KVCacheSpec(NUM_LAYERS, num_kv_heads, head_dim, block_size, args.dtype)
    caches = allocate_kv_caches(spec, num_blocks, torch.device("cpu"))
    for k_cache, v_cache in caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    scale = head_dim**-0.5
    print(
        f"host: {describe_host()}; {args.shape} attention; dtype {args.dtype}; "
        f"{torch.get_num_threads()} threads; git {git_sha()}"
    )
    print(
        "| case | kernel us (rows into L1) | kernel us (into L2) | gather + SDPA us | speed-up | "
        "kernel K/V GB/s | max abs difference |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (num_reqs, rows, seq_len) in CASES.items():
        inputs = (*make_case(num_reqs, rows, seq_len, args.shape, num_blocks, dtype, gen), scale)
        repeats = 3 * NUM_LAYERS if rows == 1 else NUM_LAYERS
        l1_s = time_per_call(kernel_path, inputs, caches, repeats)
        l2_s = time_per_call(functools.partial(kernel_path, to_l2=True), inputs, caches, repeats)
        baseline_s = time_per_call(pytorch_path, inputs, caches, repeats)
        kernel_s = min(l1_s, l2_s)
        got, expected = kernel_path(*caches[0], *inputs), pytorch_path(*caches[0], *inputs)
        difference = (got.float() - expected.float()).abs().max().item()
        kv_bytes = num_reqs * seq_len * num_kv_heads * head_dim * 2 * caches[0][0].element_size()
        rate = f"{kv_bytes / kernel_s / 1e9:.1f}" if rows == 1 else "-"
        print(
            f"| {name} | {l1_s * 1e6:,.0f} | {l2_s * 1e6:,.0f} | {baseline_s * 1e6:,.0f} | "
            f"**{baseline_s / kernel_s:.2f}x** | {rate} | {difference:.2g} |"
        )


if __name__ == "__main__":
    main()
