"""How a mixture-of-experts file's router spreads tokens over its experts, as pagedllm runs it.

    .venv/bin/python benchmarks/moe_routing.py FILE.gguf [--rows 8] [--prompt-tokens 128]

A decode step's cost on a CPU is the bytes it reads, and an MoE layer reads each expert that any row
of the step chose once. So a random-weight benchmark file times as a real model only if its routing
spreads as a trained, load-balanced router's does. This runs `--rows` requests of random token ids
(prefill, then decode steps of `--rows` rows) and prints, per step kind, the distinct experts a layer
read (mean over layers and steps) beside what routing independent and uniform over the experts would
give, E x (1 - (1 - k/E)^rows): the load-balanced ideal. A router that sends every token to the same
experts reads k a layer whatever the rows, and makes batching look cheaper than it is.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import mixtral, qwen3_moe


def uniform_distinct(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts read by `rows` tokens each choosing top_k of num_experts at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=8, help="requests decoded together (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    calls: list[tuple[int, torch.Tensor]] = []  # (rows, expert ids [rows, k]) per sparse layer call
    select = qwen3_moe.select_experts

    def recording(logits: torch.Tensor, top_k: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select(logits, top_k, *args, **kwargs)
        calls.append((logits.shape[0], ids.clone()))
        return weights, ids

    for model_module in (qwen3_moe, mixtral):  # each imported the function by name
        model_module.select_experts = recording  # type: ignore[assignment]
    llm = LLM(args.model, max_model_len=args.prompt_tokens + 64, max_num_seqs=args.rows)
    config = llm.llm_engine.facts.model_config
    assert config.num_experts and config.num_experts_per_tok, f"{args.model} is not a mixture of experts"
    rng = np.random.default_rng(args.seed)
    prompts = [
        {"prompt_token_ids": rng.integers(100, config.vocab_size, args.prompt_tokens).tolist()}
        for _ in range(args.rows)
    ]
    params = SamplingParams(temperature=0, max_tokens=1 + args.decode_steps, ignore_eos=True)
    calls.clear()  # warm-up's
    llm.generate(prompts, params, use_tqdm=False)

    distinct: dict[str, list[int]] = defaultdict(list)
    busiest: dict[str, list[float]] = defaultdict(list)
    for rows, ids in calls:
        kind = "decode" if rows == args.rows else "prefill" if rows >= args.prompt_tokens else None
        if kind is None:  # a chunk split another way: neither kind
            continue
        counts = torch.bincount(ids.flatten(), minlength=config.num_experts)
        distinct[kind].append(int((counts > 0).sum()))
        busiest[kind].append(float(counts.max()) / rows)
    e, k = config.num_experts, config.num_experts_per_tok
    print(f"{args.model}: {e} experts, top {k}")
    for kind, rows in (("prefill", args.prompt_tokens), ("decode", args.rows)):
        if not distinct[kind]:
            print(f"{kind}: no step of {rows} rows seen")
            continue
        mean = float(np.mean(distinct[kind]))
        ideal = uniform_distinct(e, k, rows)
        print(
            f"{kind} steps of {rows} rows ({len(distinct[kind])} layer calls): "
            f"{mean:.1f} distinct experts a layer, uniform routing {ideal:.1f} ({mean / ideal:.2f}x); "
            f"the busiest expert takes {np.mean(busiest[kind]):.2f} of the rows"
        )


if __name__ == "__main__":
    main()
