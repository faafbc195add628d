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
from pagedllm.layers import fused_moe


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
    select = fused_moe.select_experts

    def recording(logits: torch.Tensor, top_k: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select(logits, top_k, *args, **kwargs)
        calls.append((logits.shape[0], ids.clone()))
        return weights, ids

    fused_moe.select_experts = recording  # type: ignore[assignment]  (SparseMoeBlock's call)
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

    e, k = config.num_experts, config.num_experts_per_tok
    by_rows: dict[int, list[tuple[int, float]]] = defaultdict(list)  # rows -> (distinct, busiest's share)
    for rows, ids in calls:
        counts = torch.bincount(ids.flatten(), minlength=e)
        by_rows[rows].append((int((counts > 0).sum()), float(counts.max()) / rows))
    print(f"{args.model}: {e} experts, top {k}")
    for rows in sorted(by_rows):
        kind = "decode" if rows <= args.rows else "prefill"
        distinct = float(np.mean([d for d, _ in by_rows[rows]]))
        ideal = uniform_distinct(e, k, rows)
        print(
            f"{kind} steps of {rows} rows ({len(by_rows[rows])} layer calls): "
            f"{distinct:.1f} distinct experts a layer, uniform routing {ideal:.1f} "
            f"({distinct / ideal:.2f}x); "
            f"the busiest expert takes {np.mean([b for _, b in by_rows[rows]]):.2f} of the rows"
        )


if __name__ == "__main__":
    main()
