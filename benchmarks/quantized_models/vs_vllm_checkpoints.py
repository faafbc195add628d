"""pagedllm against vLLM's CPU build on the same AWQ / GPTQ / W8A8 checkpoints, one server at a
time, one client.

    .venv/bin/python benchmarks/quantized_models/vs_vllm_checkpoints.py --vllm-venv VENV DIR [DIR ...]

Each DIR is a quantized Hugging Face checkpoint (write_checkpoint.py writes them with random
weights); both engines serve it as it is stored: pagedllm with its integer kernel (`--dtype auto`),
vLLM with its CPU kernels for the format (`--dtype bfloat16`). For each checkpoint and each number
of requests in flight C (default 1, 8 and 32): the server starts with room for C requests and a
2 GiB KV cache, answers one warm-up request, then gets the same `pagedllm bench serve` load as
run.py's: random prompts of 512 tokens, 64 out, EOS ignored, C at a time. --rounds N measures each
cell N times, the two servers in turn. Printed: a markdown table of output tokens/s, TPOT and TTFT
medians, time to ready and peak RSS, pagedllm / vLLM; everything to OUT/results.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "vllm_compare"))
from client import bench_random  # noqa: E402
from run import MODEL_NAME, TCMALLOC, Server, host_info  # noqa: E402

PAGEDLLM = str(REPO / ".venv/bin/pagedllm")
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 64
COMMON = ["--served-model-name", MODEL_NAME, "--max-model-len", "2048"]


def server_cmd(name: str, args: argparse.Namespace, folder: Path, c: int) -> tuple[list[str], dict]:
    port = ["--port", str(args.port)]
    if name == "pagedllm":
        cmd = [
            PAGEDLLM,
            "serve",
            str(folder),
            *COMMON,
            "--max-num-seqs",
            str(c),
            "--kv-cache-memory-bytes",
            "2GiB",
        ]
        return cmd + port, dict(os.environ)
    env = os.environ | {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB, as pagedllm's
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "LD_PRELOAD": f"{TCMALLOC}:{args.vllm_venv}/lib/libiomp5.so",
    }
    cmd = [f"{args.vllm_venv}/bin/vllm", "serve", str(folder), *COMMON, "--dtype", "bfloat16"]
    cmd += ["--max-num-seqs", str(c), "--block-size", "32", "--host", "127.0.0.1"]
    return cmd + port, env


def measure(name: str, args: argparse.Namespace, folder: Path, c: int, round_number: int) -> dict:
    stem = f"{name}_{folder.name}_c{c}_r{round_number}"
    cmd, env = server_cmd(name, args, folder, c)
    server = Server(name, cmd, env, args.out / f"{stem}.log", args.port)
    try:
        ready_s = server.start(args.ready_timeout)
        server.warm_up()
        num_prompts = 3 if c == 1 else 2 * c
        figures = bench_random(
            server.url, MODEL_NAME, c, num_prompts, PROMPT_TOKENS, OUTPUT_TOKENS, args.out / f"{stem}.json"
        )
        return {**figures, "ready_s": ready_s, "peak_rss_gib": server.peak_rss / 2**30}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--vllm-venv", required=True, help="vLLM's CPU build")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=1, help="each cell this many times, servers in turn")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="vLLM's OpenMP cores")
    parser.add_argument("--port", type=int, default=8150)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "results/vs_vllm_checkpoints")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "host": host_info(),
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "runs": [],
    }
    print(
        "| checkpoint | in flight | round | pagedllm tok/s | vLLM tok/s | ratio | TPOT p50 ms | TTFT p50 ms "
        "| ready s | peak RSS GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for folder, c, round_number in itertools.product(
        args.folders, args.concurrency, range(1, args.rounds + 1)
    ):
        ours = measure("pagedllm", args, folder, c, round_number)
        theirs = measure("vllm", args, folder, c, round_number)
        run = {"checkpoint": folder.name, "concurrency": c, "round": round_number}
        results["runs"].append({**run, "pagedllm": ours, "vllm": theirs})
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        print(
            f"| {folder.name} | {c} | {round_number} | {ours['output_tokens_per_s']:.1f} | "
            f"{theirs['output_tokens_per_s']:.1f} | {ratio:.2f} | "
            f"{ours['tpot_p50_ms']:.0f} / {theirs['tpot_p50_ms']:.0f} | "
            f"{ours['ttft_p50_ms']:.0f} / {theirs['ttft_p50_ms']:.0f} | "
            f"{ours['ready_s']:.1f} / {theirs['ready_s']:.1f} | "
            f"{ours['peak_rss_gib']:.2f} / {theirs['peak_rss_gib']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
