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
the values. --rounds N measures each cell N times, the servers in turn, a table row per round.
With --vllm-venv, vLLM's CPU build serves the same shape in bfloat16 with random
weights (`--load-format dummy`, on the config pagedllm derives from the file) at 8 and 32 in
flight: the engine a user would batch with instead. With --pagedllm-variant "ARGS", pagedllm also
serves with those flags added (e.g. "--max-num-partial-prefills 1"), in the same rounds, a row of
its own against the same llama.cpp run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "vllm_compare"))
from client import bench_random  # noqa: E402
from run import MODEL_NAME, TCMALLOC, Server, host_info  # noqa: E402

PAGEDLLM = str(REPO / ".venv/bin/pagedllm")
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 64


def server_cmd(name: str, args: argparse.Namespace, gguf: Path, c: int) -> tuple[list[str], dict]:
    if name.startswith("pagedllm"):
        variant = shlex.split(args.pagedllm_variant) if name == "pagedllm-variant" else []
        return [
            PAGEDLLM, "serve", str(gguf), "--served-model-name", MODEL_NAME, "--max-num-seqs", str(c),
            "--max-model-len", "2048", "--kv-cache-memory-bytes", "2GiB", "--port", str(args.port), *variant,
        ], dict(os.environ)  # fmt: skip
    if name == "vllm":  # bfloat16, random weights (--load-format dummy) in the file's shape
        from pagedllm.model.gguf_convert import converted_folder

        env = os.environ | {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB, as pagedllm's
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "LD_PRELOAD": f"{TCMALLOC}:{args.vllm_venv}/lib/libiomp5.so",
        }
        return [
            f"{args.vllm_venv}/bin/vllm", "serve", str(converted_folder(gguf)), "--load-format", "dummy",
            "--dtype", "bfloat16", "--served-model-name", MODEL_NAME, "--max-num-seqs", str(c),
            "--max-model-len", "2048", "--block-size", "32", "--host", "127.0.0.1", "--port", str(args.port),
        ], env  # fmt: skip
    return [
        args.llama_server, "-m", str(gguf), "--alias", MODEL_NAME, "-t", str(args.threads), "-np", str(c),
        "-c", str(1024 * c), "--cont-batching", "--host", "127.0.0.1", "--port", str(args.port),
    ], dict(os.environ)  # fmt: skip


def run_client(url: str, c: int, out: Path) -> dict:
    num_prompts = 3 if c == 1 else 2 * c
    return bench_random(url, MODEL_NAME, c, num_prompts, PROMPT_TOKENS, OUTPUT_TOKENS, out)


def measure(name: str, args: argparse.Namespace, gguf: Path, c: int, round_number: int) -> dict:
    stem = f"{name}_{gguf.stem}_c{c}" + (f"_r{round_number}" if args.rounds > 1 else "")
    log = args.out / f"{stem}.log"
    cmd, env = server_cmd(name, args, gguf, c)
    server = Server(name, cmd, env, log, args.port)
    try:
        ready_s = server.start(args.ready_timeout)
        server.warm_up()
        figures = run_client(server.url, c, args.out / f"{stem}.json")
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
    parser.add_argument(
        "--vllm-venv",
        help="also vLLM's CPU build (this venv) in bfloat16 with random weights of the file's shape, "
        "at --vllm-concurrency",
    )
    parser.add_argument("--vllm-concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each file and number in flight this many times, the servers in turn each "
        "round: a shared host's speed moves from minute to minute; the rounds' spread shows how much",
    )
    parser.add_argument(
        "--pagedllm-variant",
        help='also pagedllm with these flags added (one string, e.g. "--max-num-partial-prefills 1")',
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
        "| file | in flight | round | pagedllm tok/s | llama.cpp tok/s | ratio | TPOT p50 ms | TTFT p50 ms "
        "| ready s | peak RSS GiB | vLLM bf16 tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gguf in args.files:
        for c, round_number in itertools.product(args.concurrency, range(1, args.rounds + 1)):
            ours = measure("pagedllm", args, gguf, c, round_number)
            variant = None
            if args.pagedllm_variant:
                variant = measure("pagedllm-variant", args, gguf, c, round_number)
            theirs = measure("llama.cpp", args, gguf, c, round_number)
            wants_vllm = args.vllm_venv and c in args.vllm_concurrency
            vllm = measure("vllm", args, gguf, c, round_number) if wants_vllm else None
            results["runs"].append(
                {
                    "file": gguf.name,
                    "concurrency": c,
                    "round": round_number,
                    "pagedllm": ours,
                    "pagedllm_variant": variant and {"flags": args.pagedllm_variant, **variant},
                    "llama.cpp": theirs,
                    "vllm": vllm,
                }
            )
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
            label = f"{gguf.name} | {c} | {round_number}"
            print_row(label, ours, theirs, vllm)
            if variant is not None:
                print_row(f"{label} ({args.pagedllm_variant})", variant, theirs, vllm)


def print_row(label: str, ours: dict, theirs: dict, vllm: dict | None) -> None:
    ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    vllm_cells = (
        f"{vllm['output_tokens_per_s']:.1f} | {ours['output_tokens_per_s'] / vllm['output_tokens_per_s']:.2f}"
        if vllm
        else "- | -"
    )
    print(
        f"| {label} | {ours['output_tokens_per_s']:.1f} | {theirs['output_tokens_per_s']:.1f} | "
        f"{ratio:.2f} | {ours['tpot_p50_ms']:.0f} / {theirs['tpot_p50_ms']:.0f} | "
        f"{ours['ttft_p50_ms']:.0f} / {theirs['ttft_p50_ms']:.0f} | "
        f"{ours['ready_s']:.1f} / {theirs['ready_s']:.1f} | "
        f"{ours['peak_rss_gib']:.2f} / {theirs['peak_rss_gib']:.2f} | {vllm_cells} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
