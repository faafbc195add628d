"""Output tokens/s with LoRA adapters beside the base model alone, on the same requests, in one run.

    python benchmarks/lora_throughput.py [--model M] [--adapters 4] [--rank 16] [--max-num-seqs 8]

Writes `--adapters` random PEFT adapters of `--rank` on q/k/v/o and gate/up/down (their sizes from
the model's config; random weights: speed does not depend on them), then runs the workload's
requests, all at t=0, greedy, EOS ignored, `--max-num-seqs` in flight, on two engines alternated
round by round: the base model (no --enable-lora) and the same model with --enable-lora
--max-loras N, its requests spread evenly over the adapters (request i: adapter i mod N). Prints
each round's output tokens/s and the ratio of the medians (the issue's target: >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.targets import lora_targets
from pagedllm.workload import load_requests

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "decode_heavy.jsonl"


def write_adapter(folder: Path, targets: dict, rank: int, seed: int) -> Path:
    """A PEFT folder of `rank` on every target, as PEFT saves one."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, target in targets.items():
        prefix = f"base_model.model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(
            rank, target.in_features, generator=generator
        ) / math.sqrt(target.in_features)
        tensors[f"{prefix}.lora_B.weight"] = (
            torch.randn(target.out_features, rank, generator=generator) * 0.01
        )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({n.rsplit(".", 1)[1] for n in targets}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def timed(llm: LLM, prompts: list[str], params: list[SamplingParams], adapters) -> float:
    """Output tokens/s of one round."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="cap on each request's max_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", default=str(WORKLOAD))
    args = parser.parse_args()

    requests = load_requests(args.workload, args.num_requests)
    prompts = [r.prompt for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=min(r.max_tokens, args.max_tokens), ignore_eos=True)
        for r in requests
    ]
    common = dict(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=1024,
        kv_cache_memory_bytes="1GiB",
        enable_prefix_caching=False,
        disable_log_stats=True,
    )
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    targets = lora_targets(lora.llm_engine.facts.model_config)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(
                f"adapter-{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", targets, args.rank, seed=i))
            )
            for i in range(args.adapters)
        ]
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        timed(base, prompts[:2], params[:2], None)  # warm both (first-step costs, the adapters' reads)
        timed(lora, prompts[:2], params[:2], spread[:2])
        rates: dict[str, list[float]] = {"base": [], "lora": []}
        for round_index in range(args.rounds):
            order = ["base", "lora"] if round_index % 2 == 0 else ["lora", "base"]
            for name in order:
                rate = (
                    timed(base, prompts, params, None)
                    if name == "base"
                    else timed(lora, prompts, params, spread)
                )
                rates[name].append(rate)
                print(f"round {round_index + 1} {name:5s} {rate:7.1f} output tok/s", flush=True)
    base_rate, lora_rate = statistics.median(rates["base"]), statistics.median(rates["lora"])
    print(
        f"\n{args.adapters} adapters of rank {args.rank} mixed evenly, {args.max_num_seqs} in flight, "
        f"dtype {base.llm_engine.facts.dtype}: base {base_rate:.1f}, LoRA {lora_rate:.1f} output tok/s "
        f"(medians of {args.rounds}): {lora_rate / base_rate:.2f}x"
    )
    base.shutdown()
    lora.shutdown()


if __name__ == "__main__":
    main()
