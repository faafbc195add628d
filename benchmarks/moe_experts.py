"""A mixture-of-experts file's decode speed computed three ways, in turn in one process:

- `grouped`: as served: the router on its timed float path, the pairs grouped by expert in one C++
  pass (cpu_ops.moe_align), a step's experts in two calls (cpu_ops.moe_quant_linear);
- `torch routing`: the same experts, the router through F.linear and the pairs grouped by
  PyTorch's ops (fused_moe.align_pairs), as before the C++ pass;
- `per expert`: PyTorch's routing and two calls per expert.

    .venv/bin/python benchmarks/moe_experts.py FILE.gguf [--rows 1 8] [--rounds 3]

Per round and row count: `rows` requests of 128 random token ids, 32 greedy tokens each, decoded
together; output tokens/s over the decode steps (after the first token). The ways give the same
experts' results bit for bit (tests/model/test_qwen3_moe.py; the router's paths sum in different
orders, so its logits may differ in the last bit). The rounds rotate the order of the ways; the
ratios printed are of the medians of the rounds, against `per expert` and `torch routing`.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE, Router, align_pairs

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

    choose = Router.choose_impl

    def keeping_plain(router: Router, *args: object) -> None:  # the weight as loaded, before packing
        router.plain_weight = router.weight  # type: ignore[attr-defined]
        choose(router, *args)  # type: ignore[arg-type]

    Router.choose_impl = keeping_plain  # type: ignore[method-assign]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + 16,
        max_num_seqs=max(args.rows),
        enable_prefix_caching=False,
        kv_cache_memory_bytes="1GiB",
        disable_log_stats=True,
    )
    model = llm.llm_engine.core.worker.model
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    routers = [m for m in model.modules() if isinstance(m, Router)]
    served = [(block.grouped, block.align) for block in blocks]
    router_paths = [(router.impl, router.weight) for router in routers]
    plain_weights = [router.plain_weight for router in routers]  # type: ignore[attr-defined]
    if not blocks or any(grouped is None for grouped, _ in served):
        raise SystemExit(f"{args.model}: no experts packed for the integer kernel, nothing to compare")

    def use(way: str) -> None:
        for block, (grouped, align) in zip(blocks, served, strict=True):
            block.grouped = grouped if way != "per expert" else None
            block.align = align if way == "grouped" else align_pairs
        for router, (impl, weight), plain in zip(routers, router_paths, plain_weights, strict=True):
            router.impl, router.weight = (impl, weight) if way == "grouped" else (F.linear, plain)

    ways = ["grouped", "torch routing", "per expert"]
    for rows in args.rows:
        decode_tok_s(llm, rows, seed=1000)  # warm-up
        rates: dict[str, list[float]] = {way: [] for way in ways}
        for r in range(args.rounds):
            for way in ways[r % 3 :] + ways[: r % 3]:
                use(way)
                rates[way].append(decode_tok_s(llm, rows, seed=r))
                print(
                    f"{rows} rows, round {r + 1}, {way:13s}: {rates[way][-1]:6.2f} output tok/s", flush=True
                )
        medians = {way: statistics.median(values) for way, values in rates.items()}
        print(
            f"{rows} rows: " + " / ".join(f"{way} {medians[way]:.2f}" for way in ways) + " output tok/s; "
            f"grouped / torch routing {medians['grouped'] / medians['torch routing']:.2f}x, "
            f"grouped / per expert {medians['grouped'] / medians['per expert']:.2f}x"
        )
    use("grouped")


if __name__ == "__main__":
    main()
