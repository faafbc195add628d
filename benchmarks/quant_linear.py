"""The quantized projection kernel (4 and 8 bits) against the unquantized few-rows kernel, in one run.

    .venv/bin/python benchmarks/quant_linear.py
    .venv/bin/python benchmarks/quant_linear.py --rows 1 8 --layers 4 --mins

A Llama-3.2-1B-class layer's projections: qkv (3,072 x 2,048), o (2,048 x 2,048), gate_up
(16,384 x 2,048) and down (2,048 x 8,192), 16 layers each with its own weights (so a pass streams
them from memory, as a decode step does): bfloat16 through few_rows_linear (float32 on a host
without AVX512-BF16, whose build has no bfloat16 kernel: twice the bytes), 4-bit as GGUF's Q4_0
(mins = -8 * scale: folded, 4.5 bits per weight) and 8-bit as Q8_0 (no mins, 8.5 bits); --mins
stores free mins instead (Q4_1-like, 5 and 9 bits). For each row count, milliseconds per pass over
all 64 products (the fastest of passes taken in turn: on a host shared with other work the median
moves with its load, the fastest much less), each quantized kernel's speed-up over that, at one
row the packed bytes' effective GB/s beside what the host streams at all (torch.sum over 1 GiB
of float32, fastest of 5, on as many threads), and at the last row count the multiply-adds per
second of each kernel per thread, to set beside a core's ceiling (benchmarks/cpu_peak.c).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.kernels import cpu_ops

LAYER_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (out, in): qkv, o, gate_up, down
NUM_LAYERS = 16
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]


def quantized_layers(bits: int, with_mins: bool, num_layers: int, gen: torch.Generator) -> list[torch.Tensor]:
    packed = []
    for _ in range(num_layers):
        for n, k in LAYER_SHAPES:
            low, high = (0, 16) if bits == 4 else (-128, 128)
            q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)
            scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
            if with_mins:
                mins = (torch.randn(n, k // 32, generator=gen) * 0.01).half().float()
            else:
                mins = -8 * scales if bits == 4 else None
            packed.append(cpu_ops.pack_quant_linear(q, scales, mins, bits))
    return packed


def pass_seconds(calls) -> float:
    start = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    parser.add_argument("--mins", action="store_true", help="free mins (Q4_1-like) instead of Q4_0 / Q8_0")
    args = parser.parse_args()
    if not cpu_ops.serves_quant_linear(4, 2048, 2048):
        raise SystemExit("no quantized kernel in this CPU's build")
    available = torch.ops.pagedllm.few_rows_linear_available
    kernels = {"bf16": ("bfloat16", torch.bfloat16), "f32": ("float32", torch.float32)}  # the first built
    base_name = next((label for label, (kernel, _) in kernels.items() if available(kernel)), None)
    if base_name is None:
        raise SystemExit("no few-rows kernel in this CPU's build")
    base = kernels[base_name][1]
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * args.layers
    unquantized = [
        cpu_ops.pack_few_rows((torch.randn(n, k, generator=gen) * 0.02).to(base)) for n, k in shapes
    ]
    quantized = {bits: quantized_layers(bits, args.mins, args.layers, gen) for bits in (4, 8)}
    packed_bytes = {bits: sum(p.numel() for p in packed) for bits, packed in quantized.items()}
    num_weights = sum(n * k for n, k in shapes)
    print(f"host: {describe_host()}; {torch.get_num_threads()} threads; git {git_sha()}")
    print(
        f"{args.layers} layers, {num_weights / 1e9:.2f} G weights: {base_name} "
        f"{num_weights * base.itemsize / 1e9:.2f} GB, "
        + ", ".join(
            f"{bits}-bit {b / 1e9:.2f} GB ({b * 8 / num_weights:.2f} bits/weight)"
            for bits, b in packed_bytes.items()
        )
    )
    print(f"| rows | {base_name} ms | 4-bit ms | 4-bit speed-up | 8-bit ms | 8-bit speed-up |")
    print("|---|---|---|---|---|---|")
    gbs = {}
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen).to(base) for _, k in LAYER_SHAPES}
        paths = {
            base_name: [
                lambda x=inputs[k], w=w: cpu_ops.few_rows_linear(x, w, None)
                for (_, k), w in zip(shapes, unquantized, strict=True)
            ],
            **{
                bits: [
                    lambda x=inputs[k], w=w, n=n, k=k, bits=bits: cpu_ops.quant_linear(x, w, bits, n, k, None)
                    for (n, k), w in zip(shapes, packed, strict=True)
                ]
                for bits, packed in quantized.items()
            },
        }
        repeats = max(3, min(20, 64 // rows))
        times: dict = {name: [] for name in paths}
        for calls in paths.values():
            pass_seconds(calls)  # warm-up
        for _ in range(repeats):
            for name, calls in paths.items():
                times[name].append(pass_seconds(calls))
        ms = {name: min(t) * 1e3 for name, t in times.items()}
        if rows == 1:
            gbs = {bits: packed_bytes[bits] / ms[bits] / 1e6 for bits in quantized}
            gbs[base_name] = num_weights * base.itemsize / ms[base_name] / 1e6
        cells = " | ".join(f"{ms[bits]:.2f} | **{ms[base_name] / ms[bits]:.2f}x**" for bits in quantized)
        print(f"| {rows} | {ms[base_name]:.2f} | {cells} |")
    per_thread = args.rows[-1] * num_weights / 1e6 / torch.get_num_threads()  # ms: the last row count's
    macs = {name if isinstance(name, str) else f"{name}-bit": per_thread / t for name, t in ms.items()}
    rates = ", ".join(f"{name} {rate:.1f}" for name, rate in macs.items())
    print(f"multiply-adds per thread at {args.rows[-1]} rows, G/s (ceiling: benchmarks/cpu_peak.c): {rates}")
    if gbs:
        print("effective GB/s at 1 row: " + ", ".join(f"{name}: {v:.1f}" for name, v in gbs.items()))
        print(f"the host streams {streaming_gbs():.1f} GB/s (torch.sum over 1 GiB of float32)")


def streaming_gbs() -> float:
    """What a plain read of memory reaches here: the ceiling a decode step's weights stream at."""
    floats = torch.ones(1 << 28)
    fastest = min(pass_seconds([floats.sum]) for _ in range(5))
    return floats.numel() * floats.element_size() / fastest / 1e9


if __name__ == "__main__":
    main()
