"""The customer-service case on one GGUF: every request starts with the same system prompt.

    .venv/bin/python benchmarks/quantized_models/system_prompt.py FILE.gguf [--prefix-tokens 500]

One pagedllm server per setting, prefix caching on, then off (`--no-enable-prefix-caching`: every
request computes the system prompt again), each with room for the largest number in flight. For
each number of requests in flight C (default 1 and 8): `pagedllm bench serve` with random prompts
of --prefix-tokens shared tokens (one random prefix, the same for every request, as vLLM's
`--random-prefix-len`) plus --question-tokens of their own, --output-tokens out, EOS ignored,
C at a time. With caching on, one request with that prefix runs first (what a
`--prefix-cache-warmup` file does at start-up), so every measured request finds it cached.
Printed: a markdown table of output tokens/s, TTFT and TPOT medians, cached / uncached; with each
server's time to ready, peak RSS and its start-up lines on weights, KV cache and concurrency.
Everything to OUT/results.json, logs to OUT/*.log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "vllm_compare"))
from client import bench_random  # noqa: E402
from run import MODEL_NAME, Server, host_info  # noqa: E402

PAGEDLLM = str(REPO / ".venv/bin/pagedllm")
START_UP_LINES = ("weights take", "KV cache size", "Maximum concurrency", "prefix cache")


def bench(server: Server, args: argparse.Namespace, c: int, num_prompts: int, out: Path) -> dict:
    return bench_random(
        server.url,
        MODEL_NAME,
        c,
        num_prompts,
        args.question_tokens,
        args.output_tokens,
        out,
        prefix_len=args.prefix_tokens,
    )


def measure(cached: bool, args: argparse.Namespace) -> dict:
    name = "cached" if cached else "uncached"
    cmd = [
        PAGEDLLM, "serve", str(args.gguf), "--served-model-name", MODEL_NAME,
        "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", args.kv_cache_memory_bytes, "--port", str(args.port),
        "--enable-prefix-caching" if cached else "--no-enable-prefix-caching",
    ]  # fmt: skip
    server = Server(name, cmd, dict(os.environ), args.out / f"{name}.log", args.port)
    try:
        figures: dict = {"ready_s": server.start(args.ready_timeout)}
        if cached:  # the system prompt computed once, as a warm-up file would at start-up
            bench(server, args, 1, 1, args.out / "warm_up.json")
        for c in args.concurrency:
            num_prompts = max(args.min_prompts, c)
            figures[str(c)] = bench(server, args, c, num_prompts, args.out / f"{name}_c{c}.json")
        figures["peak_rss_gib"] = server.peak_rss / 2**30
        figures["start_up"] = server.log_lines(*START_UP_LINES)
        return figures
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--prefix-tokens", type=int, default=500)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--min-prompts", type=int, default=3, help="requests per run at least (else C)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", default="4GiB")
    parser.add_argument("--port", type=int, default=8160)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=REPO / "results/system_prompt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "host": host_info(),
        "file": str(args.gguf),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    for cached in (True, False):
        results["cached" if cached else "uncached"] = measure(cached, args)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    hit, miss = results["cached"], results["uncached"]
    print("| in flight | output tok/s cached / uncached | ratio | TTFT p50 ms | TPOT p50 ms |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        a, b = hit[str(c)], miss[str(c)]
        print(
            f"| {c} | {a['output_tokens_per_s']:.2f} / {b['output_tokens_per_s']:.2f} | "
            f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f} | "
            f"{a['ttft_p50_ms']:,.0f} / {b['ttft_p50_ms']:,.0f} | "
            f"{a['tpot_p50_ms']:.0f} / {b['tpot_p50_ms']:.0f} |"
        )
    for label, figures in (("cached", hit), ("uncached", miss)):
        print(f"\n{label}: ready in {figures['ready_s']:.1f} s, peak RSS {figures['peak_rss_gib']:.2f} GiB")
        for line in figures["start_up"]:
            print(f"    {line}")


if __name__ == "__main__":
    main()
