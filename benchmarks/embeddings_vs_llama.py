"""Embeddings per second: pagedllm's /v1/embeddings beside llama.cpp's server in embedding mode, on
the same GGUF file, one server at a time, the same client.

    .venv/bin/python benchmarks/embeddings_vs_llama.py --llama-server $LLAMA_CPP_BUILD/bin/llama-server \
        [--rounds 2] [FILE.gguf]

Inputs: --num-inputs token-id lists of --input-tokens random ids each (token ids, so neither
tokenizer is involved), one input a request, --concurrency requests in flight. pagedllm: `serve
FILE --max-num-seqs C`; llama.cpp: `llama-server -m FILE --embedding --pooling last -np C -t
THREADS` with a batch that holds every input in flight (`-b`, `-ub`: its embedding mode takes an
input whole in one batch).
Both pool the last token and normalize. Printed per server and round: embeddings/s over the run,
p50 latency, and the cosine between the two servers' vectors of the first input (the same model
should give about the same vector); rounds alternate the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "vllm_compare"))
from run import MODEL_NAME, Server  # noqa: E402


def server_cmd(name: str, args: argparse.Namespace) -> list[str]:
    if name == "pagedllm":
        return [
            str(REPO / ".venv/bin/pagedllm"), "serve", str(args.file), "--served-model-name", MODEL_NAME,
            "--max-num-seqs", str(args.concurrency), "--max-model-len", "1024", "--port", str(args.port),
        ]  # fmt: skip
    batch = str(max(512, args.input_tokens * args.concurrency))  # every input in flight in one batch
    return [
        args.llama_server, "-m", str(args.file), "--alias", MODEL_NAME, "--embedding", "--pooling", "last",
        "-np", str(args.concurrency), "-c", str(args.concurrency * 1024), "-b", batch, "-ub", batch,
        "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip


async def run_client(url: str, inputs: list[list[int]], concurrency: int) -> tuple[float, list[float], list]:
    """(embeddings/s, latencies in s, the first input's vector)."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    vectors: dict[int, list[float]] = {}

    async def one(index: int, ids: list[int]) -> None:
        async with gate, httpx.AsyncClient(timeout=600) as client:  # a connection each: llama-server
            start = time.perf_counter()
            response = await client.post(url + "/v1/embeddings", json={"model": MODEL_NAME, "input": ids})
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
            vectors[index] = response.json()["data"][0]["embedding"]

    start = time.perf_counter()
    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(inputs)))
    return len(inputs) / (time.perf_counter() - start), latencies, vectors[0]


def measure(name: str, args: argparse.Namespace, inputs: list[list[int]], round_number: int) -> dict:
    log = args.out / f"{name}_r{round_number}.log"
    server = Server(name, server_cmd(name, args), dict(os.environ), log, args.port)
    try:
        ready_s = server.start(args.ready_timeout)
        asyncio.run(run_client(server.url, inputs[:2], 2))  # warm-up
        rate, latencies, first = asyncio.run(run_client(server.url, inputs, args.concurrency))
        return {
            "embeddings_per_s": rate,
            "p50_latency_s": statistics.median(latencies),
            "ready_s": ready_s,
            "peak_rss_gib": server.peak_rss / 2**30,
            "first": first,
        }
    finally:
        server.stop()


def main() -> None:
    from pagedllm.model.locate import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "file", nargs="?", type=Path, default=None, help="a GGUF (default: the default model's)"
    )
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--num-inputs", type=int, default=64)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8160)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "results/embeddings")
    args = parser.parse_args()
    args.file = args.file or default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    inputs = [[rng.randrange(1000, 30000) for _ in range(args.input_tokens)] for _ in range(args.num_inputs)]
    print("| round | server | embeddings/s | p50 latency s | ready s | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    rates: dict[str, list[float]] = {"pagedllm": [], "llama.cpp": []}
    firsts = {}
    for r in range(1, args.rounds + 1):
        for name in ("pagedllm", "llama.cpp") if r % 2 else ("llama.cpp", "pagedllm"):
            result = measure(name, args, inputs, r)
            rates[name].append(result["embeddings_per_s"])
            firsts[name] = np.asarray(result.pop("first"))
            print(
                f"| {r} | {name} | {result['embeddings_per_s']:.2f} | {result['p50_latency_s']:.2f} | "
                f"{result['ready_s']:.1f} | {result['peak_rss_gib']:.2f} |",
                flush=True,
            )
    a, b = firsts["pagedllm"], firsts["llama.cpp"]
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    ratio = statistics.median(rates["pagedllm"]) / statistics.median(rates["llama.cpp"])
    print(f"pagedllm / llama.cpp embeddings/s (medians): {ratio:.2f}x; first vectors' cosine {cosine:.5f}")


if __name__ == "__main__":
    main()
