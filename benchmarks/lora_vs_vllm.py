"""LoRA served beside vLLM's CPU build: the same base model and adapters, one server at a time.

    .venv/bin/python benchmarks/lora_vs_vllm.py [--adapters 4] [--rank 16] [--concurrency 8]

Writes the embedded SmolLM2-135M-Instruct as an HF folder (vllm_compare/write_hf_model.py) and
`--adapters` random PEFT adapters of `--rank` on q/k/v/o and gate/up/down, then starts each server
with --enable-lora --lora-modules (--max-loras N, --max-lora-rank R, --max-num-seqs C) and runs,
alternated round by round, the same requests naming the base model and naming the adapters in
turn (request i: adapter i mod N), C in flight, greedy, EOS ignored. Prints each server's output
tokens/s for both and the ratio. A server that will not start with LoRA is reported with the end
of its log.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vllm_compare"))
sys.path.insert(0, str(HERE))
from lora_throughput import WORKLOAD, write_adapter  # noqa: E402
from run import MODEL_NAME, REPO, Server, host_info, pick_dtype, server_cmd  # noqa: E402
from write_hf_model import write_hf_model  # noqa: E402

from pagedllm.lora.targets import lora_targets  # noqa: E402
from pagedllm.model.config_reader import model_config_from_folder  # noqa: E402
from pagedllm.workload import load_requests  # noqa: E402


async def one_round(
    url: str, models: list[str], prompts: list[str], max_tokens: int, concurrency: int
) -> float:
    """Output tokens/s of the prompts, request i naming models[i % len(models)]."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:

        async def send(i: int) -> int:
            body = {
                "model": models[i % len(models)],
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with limit:
                response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(send(i) for i in range(len(prompts))))
    return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--vllm-venv", default=str(REPO.parent / "peers/vllm-venv"))
    parser.add_argument("--servers", nargs="+", default=["pagedllm", "vllm"])
    args = parser.parse_args()

    host = host_info()
    dtype, why = pick_dtype(host["flags"])
    print(f"host: {host['cpu']}, {host['cores']} cores; dtype {dtype} ({why})", flush=True)
    prompts = [r.prompt for r in load_requests(WORKLOAD, args.num_requests)]
    out = REPO / "results" / "lora"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_hf_model(model_dir, dtype)
        targets = lora_targets(model_config_from_folder(model_dir))
        names = [f"adapter-{i}" for i in range(args.adapters)]
        modules = [
            f"{name}={write_adapter(Path(tmp) / name, targets, args.rank, seed=i)}"
            for i, name in enumerate(names)
        ]
        results = {}
        for name in args.servers:
            cmd, env = server_cmd(name, args, model_dir, dtype, args.concurrency)
            cmd += ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
            cmd += ["--lora-modules", *modules]
            server = Server(name, cmd, env, out / f"{name}.log", args.port)
            print(f"\n== {name}: {' '.join(cmd)}", flush=True)
            try:
                ready = server.start(900)
            except RuntimeError as error:
                print(f"{name} did not start with LoRA:\n{error}", flush=True)
                results[name] = None
                server.stop()
                continue
            try:
                asyncio.run(
                    one_round(server.url, [MODEL_NAME, *names], prompts[:5], 8, args.concurrency)
                )  # warm
                rates: dict[str, list[float]] = {"base": [], "lora": []}
                for round_index in range(args.rounds):
                    for kind in ("base", "lora") if round_index % 2 == 0 else ("lora", "base"):
                        models = [MODEL_NAME] if kind == "base" else names
                        rate = asyncio.run(
                            one_round(server.url, models, prompts, args.max_tokens, args.concurrency)
                        )
                        rates[kind].append(rate)
                        print(
                            f"{name} round {round_index + 1} {kind:4s} {rate:7.1f} output tok/s", flush=True
                        )
                results[name] = {kind: statistics.median(values) for kind, values in rates.items()}
                print(f"{name}: ready in {ready:.0f} s", flush=True)
            finally:
                server.stop()
    setting = f"{args.adapters} adapters of rank {args.rank}, {args.concurrency} in flight, {dtype}"
    print(f"\n{setting}, output tok/s (medians):")
    print("| server | base | LoRA mixed | LoRA / base |\n|---|---|---|---|")
    for name, figures in results.items():
        if figures is None:
            print(f"| {name} | did not start with LoRA (log: results/lora/{name}.log) | | |")
        else:
            base, lora = figures["base"], figures["lora"]
            print(f"| {name} | {base:.1f} | {lora:.1f} | {lora / base:.2f} |")
    if all(results.get(n) for n in ("pagedllm", "vllm")):
        ratio = results["pagedllm"]["lora"] / results["vllm"]["lora"]
        print(f"\npagedllm / vLLM with the adapters: {ratio:.2f}x")


if __name__ == "__main__":
    main()
