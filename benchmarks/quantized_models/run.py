"""pagedllm against llama.cpp's server on the same GGUF files, one server at a time, one client.

    .venv/bin/python benchmarks/quantized_models/run.py --llama-server PATH FILE.gguf [FILE.gguf ...]

For each file and each number of requests in flight C (default 1 and 8): the server starts with
room for C requests (pagedllm `--max-num-seqs C`, its GGUF blocks kept quantized, `--dtype auto`;
llama.cpp `-np C -t THREADS --cont-batching`, a context of C x 1,024 tokens), answers one warm-up
request, then gets the same `pagedllm bench serve` command: random prompts of 512 tokens, 64
tokens out, EOS ignored, C at a time. Printed: a markdown table of output tokens/s, TPOT p50 and
TTFT p50 per server and the ratio pagedllm / llama.cpp, with each server's time to ready and peak
RSS; everything to OUT/results.json, logs to OUT/*.log. Files with random weights (see
write_gguf.py) time the same as real ones of their shapes: the work per token does not depend on
the values.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "vllm_compare"))
from run import MODEL_NAME, Server, host_info  # noqa: E402

PAGEDLLM = str(REPO / ".venv/bin/pagedllm")
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 64


def server_cmd(name: str, args: argparse.Namespace, gguf: Path, c: int) -> list[str]:
    if name == "pagedllm":
        return [
            PAGEDLLM, "serve", str(gguf), "--served-model-name", MODEL_NAME, "--max-num-seqs", str(c),
            "--max-model-len", "2048", "--kv-cache-memory-bytes", "2GiB", "--port", str(args.port),
        ]  # fmt: skip
    return [
        args.llama_server, "-m", str(gguf), "--alias", MODEL_NAME, "-t", str(args.threads), "-np", str(c),
        "-c", str(1024 * c), "--cont-batching", "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip


def run_client(url: str, c: int, out: Path) -> dict:
    num_prompts = 3 if c == 1 else 2 * c
    cmd = [
        str(REPO / ".venv/bin/python"), "-m", "pagedllm", "bench", "serve", "--base-url", url,
        "--served-model-name", MODEL_NAME, "--dataset-name", "random",
        "--random-input-len", str(PROMPT_TOKENS),
        "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(c), "--output-json", str(out),
        "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())
    return {
        "output_tokens_per_s": summary["output_throughput"],
        "tpot_p50_ms": summary["median_tpot_ms"],
        "ttft_p50_ms": summary["median_ttft_ms"],
        "completed": summary["completed"],
    }


def measure(name: str, args: argparse.Namespace, gguf: Path, c: int) -> dict:
    log = args.out / f"{name}_{gguf.stem}_c{c}.log"
    server = Server(name, server_cmd(name, args, gguf, c), dict(os.environ), log, args.port)
    try:
        ready_s = server.start(args.ready_timeout)
        server.warm_up()
        figures = run_client(server.url, c, args.out / f"{name}_{gguf.stem}_c{c}.json")
        return {**figures, "ready_s": ready_s, "peak_rss_gib": server.peak_rss / 2**30}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t (pagedllm: all cores)"
    )
    parser.add_argument("--port", type=int, default=8150)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "results/quantized_models")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "host": host_info(),
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "runs": [],
    }
    print(
        "| file | in flight | pagedllm tok/s | llama.cpp tok/s | ratio | TPOT p50 ms | TTFT p50 ms "
        "| ready s | peak RSS GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for gguf in args.files:
        for c in args.concurrency:
            ours, theirs = measure("pagedllm", args, gguf, c), measure("llama.cpp", args, gguf, c)
            results["runs"].append(
                {"file": gguf.name, "concurrency": c, "pagedllm": ours, "llama.cpp": theirs}
            )
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
            ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
            print(
                f"| {gguf.name} | {c} | {ours['output_tokens_per_s']:.1f} | "
                f"{theirs['output_tokens_per_s']:.1f} | "
                f"{ratio:.2f} | {ours['tpot_p50_ms']:.0f} / {theirs['tpot_p50_ms']:.0f} | "
                f"{ours['ttft_p50_ms']:.0f} / {theirs['ttft_p50_ms']:.0f} | "
                f"{ours['ready_s']:.1f} / {theirs['ready_s']:.1f} | "
                f"{ours['peak_rss_gib']:.2f} / {theirs['peak_rss_gib']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
