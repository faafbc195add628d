"""A mixture-of-experts file's decode speed with its experts grouped (cpu_ops.moe_quant_linear: two
calls a layer for all of a step's experts) and one call per expert, in turn in one process.

    .venv/bin/python benchmarks/moe_experts.py FILE.gguf [--rows 1 8] [--rounds 3]

Per round and row count: `rows` requests of 128 random token ids, 32 greedy tokens each, decoded
together; output tokens/s over the decode steps (after the first token). Both ways compute the same
results bit for bit (tests/model/test_qwen3_moe.py), so only the time differs. The rounds alternate
the two ways; the ratio printed is grouped / per expert, the medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 32


def decode_tok_s(llm: LLM, rows: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    vocab = llm.llm_engine.facts.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab, PROMPT_TOKENS).tolist()} for _ in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    start = max(o.metrics.first_token_time for o in outputs)  # every request past its prefill
    end = max(o.metrics.last_token_time for o in outputs)
    return rows * (OUTPUT_TOKENS - 1) / (end - start) if end > start else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + 16,
        max_num_seqs=max(args.rows),
        enable_prefix_caching=False,
        kv_cache_memory_bytes="1GiB",
        disable_log_stats=True,
    )
    blocks = [m for m in llm.llm_engine.core.worker.model.modules() if isinstance(m, FusedMoE)]
    grouped = [block.grouped for block in blocks]
    if not blocks or any(g is None for g in grouped):
        raise SystemExit(f"{args.model}: no experts packed for the integer kernel, nothing to compare")

    def use(way: str) -> None:
        for block, kernel in zip(blocks, grouped, strict=True):
            block.grouped = kernel if way == "grouped" else None

    for rows in args.rows:
        decode_tok_s(llm, rows, seed=1000)  # warm-up
        rates: dict[str, list[float]] = {"grouped": [], "per expert": []}
        for r in range(args.rounds):
            for way in ("grouped", "per expert") if r % 2 == 0 else ("per expert", "grouped"):
                use(way)
                rates[way].append(decode_tok_s(llm, rows, seed=r))
                rate = rates[way][-1]
                print(f"{rows} rows, round {r + 1}, {way:10s}: {rate:6.2f} output tok/s", flush=True)
        medians = {way: statistics.median(values) for way, values in rates.items()}
        print(
            f"{rows} rows: grouped {medians['grouped']:.2f} / per expert {medians['per expert']:.2f} output "
            f"tok/s = {medians['grouped'] / medians['per expert']:.2f}x"
        )
    use("grouped")


if __name__ == "__main__":
    main()
