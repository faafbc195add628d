"""The few-rows projection kernel against oneDNN's packed GEMM, in one run.

    .venv/bin/python benchmarks/few_rows_linear.py                  # bfloat16 (AVX512-BF16 CPUs)
    .venv/bin/python benchmarks/few_rows_linear.py --dtype float32  # float32 (the AVX2 kernel)

SmolLM2-135M's projections: 30 layers of qkv (960 x 576), o (576 x 576), gate_up (3,072 x 576)
and down (576 x 1,536), each layer its own weights (212 MB in bfloat16, so a step streams them
from memory as a decode step does), and the tied lm_head (49,152 x 576). For each row count,
milliseconds for all 30 layers' products and for one lm_head product, through oneDNN (weights
packed as the engine packs them where the kernel does not serve) and through few_rows_linear,
and the kernel's speed-up. The float32 kernel is the AVX2 one: on an AVX-512 CPU the engine
keeps oneDNN for float32, so compare there under benchmarks/avx2_restricted.sh's settings
(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 and the kernels built -march=znver3).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import onednn_linear, pack_onednn

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of each projection
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576
ROWS = [1, 4, 8, 16, 32, 64, 128, 256, 2048]


def smollm2_weights(dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random weights of SmolLM2's 30 layers' projections and its lm_head, seeded."""
    gen = torch.Generator().manual_seed(0)
    plain = [
        (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        for _ in range(NUM_LAYERS)
        for n, k in LAYER_SHAPES
    ]
    return plain, (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(dtype)


def time_calls(fn, calls: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> float:
    """Seconds per pass over the calls (x, weight)."""
    for x, w in calls:
        fn(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        for x, w in calls:
            fn(x, w)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu_ops.is_built() or not torch.ops.pagedllm.few_rows_linear_available(args.dtype):
        raise SystemExit(f"no few-rows kernel for {args.dtype} in this CPU's build")
    plain, head = smollm2_weights(dtype)
    gen = torch.Generator().manual_seed(1)  # the inputs
    paths = {
        "oneDNN": (lambda x, w: onednn_linear(x, w), pack_onednn),
        "few_rows_linear": (lambda x, w: cpu_ops.few_rows_linear(x, w, None), cpu_ops.pack_few_rows),
    }
    packed = {name: ([pack_fn(w) for w in plain], pack_fn(head)) for name, (_, pack_fn) in paths.items()}
    print(f"host: {describe_host()}; dtype {args.dtype}; {torch.get_num_threads()} threads; git {git_sha()}")
    print(
        "| rows | 30 layers: oneDNN ms | few_rows_linear ms | speed-up "
        "| lm_head: oneDNN ms | few_rows_linear ms | speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in LAYER_SHAPES}
        head_input = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        repeats = max(2, 256 // rows)
        times = {}
        for name, (fn, _) in paths.items():
            layers, lm_head = packed[name]
            layer_calls = [
                (inputs[k], w) for (_, k), w in zip(LAYER_SHAPES * NUM_LAYERS, layers, strict=True)
            ]
            times[name] = (
                time_calls(fn, layer_calls, repeats),
                time_calls(fn, [(head_input, lm_head)], repeats),
            )
        (dnn_layers, dnn_head), (few_layers, few_head) = times["oneDNN"], times["few_rows_linear"]
        (dnn, _), (few, _) = paths["oneDNN"], paths["few_rows_linear"]
        x0 = inputs[LAYER_SHAPES[0][1]]
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4  # the two sum in different orders
        torch.testing.assert_close(
            few(x0, packed["few_rows_linear"][0][0]),
            dnn(x0, packed["oneDNN"][0][0]),
            rtol=tolerance,
            atol=tolerance,
        )
        layers_cells = f"{dnn_layers * 1e3:.2f} | {few_layers * 1e3:.2f} | **{dnn_layers / few_layers:.2f}x**"
        head_cells = f"{dnn_head * 1e3:.2f} | {few_head * 1e3:.2f} | **{dnn_head / few_head:.2f}x**"
        print(f"| {rows} | {layers_cells} | {head_cells} |")


if __name__ == "__main__":
    main()
