"""`pagedllm eval kv-quant`: what an 8-bit KV cache costs in quality, against the `auto` cache.

The same model runs the same fixed texts and prompts (eval/data/) twice, first with the `auto`
cache, then with the quantized one (--kv-cache-dtype; int8 when it says auto), each engine built
from the same flags:
- perplexity: every token of the texts scored teacher-forced through the paged path
  (prompt_logprobs), exp(mean negative log-likelihood);
- greedy agreement: the fraction of prompts whose first N greedy tokens are identical, and the
  mean number of tokens until the first divergence (N where there is none);
- capacity: blocks of the quantized cache / blocks of the auto cache at the same budget (and
  against a bfloat16 cache, the usual baseline on accelerators);
- finiteness: every logprob seen (prompt and generated) is finite, so no NaN/inf logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from dataclasses import asdict, dataclass

from pagedllm.config import EngineConfig, add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.eval.scoring import load_eval_set, perplexity, run_generation, tokens_until_divergence
from pagedllm.logger import configure_logging
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.kv_cache import KVCacheSpec

_EVAL_MAX_MODEL_LEN = 2048  # the texts are shorter; a small cache starts fast
_EVAL_KV_CACHE_BYTES = 1 << 30


@dataclass
class CacheRun:
    """One engine's figures on the eval set."""

    kv_cache_dtype: str
    num_blocks: int
    bytes_per_token: int
    bfloat16_blocks: int  # what a bfloat16 cache gets from the same budget, the usual baseline
    perplexity: float
    num_scored_tokens: int
    greedy_token_ids: list[list[int]]
    all_finite: bool


def run_cache(config: EngineConfig, texts: list[str], prompts: list[str], max_tokens: int) -> CacheRun:
    """Load an engine for `config`, score the texts and generate greedily for the prompts."""
    engine = LLMEngine(config)
    ppl, num_scored, ppl_finite = perplexity(engine, texts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = run_generation(engine, prompts, params)
    generated_finite = all(
        math.isfinite(lp.logprob)
        for o in outputs
        for step in o.outputs[0].logprobs or []
        for lp in step.values()
    )
    plan = engine.facts.kv_cache_plan
    return CacheRun(
        kv_cache_dtype=plan.spec.cache_dtype,
        num_blocks=plan.num_blocks,
        bytes_per_token=plan.spec.bytes_per_token,
        bfloat16_blocks=KVCacheSpec.for_model(
            engine.facts.model_config, plan.spec.block_size, "bfloat16"
        ).num_blocks_for(plan.budget_bytes),
        perplexity=ppl,
        num_scored_tokens=num_scored,
        greedy_token_ids=[o.outputs[0].token_ids for o in outputs],
        all_finite=ppl_finite and generated_finite,
    )


def compare(base: CacheRun, quant: CacheRun, max_tokens: int) -> dict:
    """The report's figures: quant against base."""
    divergence = [
        tokens_until_divergence(a, b)
        for a, b in zip(base.greedy_token_ids, quant.greedy_token_ids, strict=True)
    ]
    return {
        "perplexity_relative_diff": quant.perplexity / base.perplexity - 1,
        "greedy_agreement": sum(d == max_tokens for d in divergence) / len(divergence),
        "greedy_tokens_compared": max_tokens,
        "mean_tokens_until_divergence": sum(divergence) / len(divergence),
        "tokens_until_divergence": divergence,
        "capacity_ratio": quant.num_blocks / base.num_blocks,
        "capacity_ratio_vs_bfloat16": quant.num_blocks / quant.bfloat16_blocks,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> None:
    configure_logging()
    config = engine_config_from_args(args, disable_log_stats=True)
    if config.kv_cache_dtype == "auto":
        config = config.replace(kv_cache_dtype="int8")
    if config.max_model_len is None:
        config = config.replace(max_model_len=_EVAL_MAX_MODEL_LEN)
    if config.kv_cache_memory_bytes is None and config.num_gpu_blocks_override is None:
        config = config.replace(kv_cache_memory_bytes=_EVAL_KV_CACHE_BYTES)
    texts, prompts = load_eval_set("texts"), load_eval_set("prompts")
    base = run_cache(config.replace(kv_cache_dtype="auto"), texts, prompts, args.max_tokens)
    gc.collect()  # one engine's KV cache at a time
    quant = run_cache(config, texts, prompts, args.max_tokens)
    figures = compare(base, quant, args.max_tokens)
    report = {"model": config.model, "base": asdict(base), "quantized": asdict(quant), **figures}
    for run in (report["base"], report["quantized"]):
        del run["greedy_token_ids"]
    print(json.dumps(report, indent=2) if args.json else format_report(base, quant, figures, len(prompts)))


def format_report(base: CacheRun, quant: CacheRun, figures: dict, num_prompts: int) -> str:
    n = figures["greedy_tokens_compared"]
    agree = round(figures["greedy_agreement"] * num_prompts)
    return "\n".join(
        [
            f"{'':<28}{base.kv_cache_dtype + ' (auto)':>18}{quant.kv_cache_dtype:>14}",
            f"{'perplexity':<28}{base.perplexity:>18.4f}{quant.perplexity:>14.4f}"
            f"  ({figures['perplexity_relative_diff']:+.2%}, {quant.num_scored_tokens:,} tokens)",
            f"{'bytes per token':<28}{base.bytes_per_token:>18,}{quant.bytes_per_token:>14,}",
            f"{'KV cache blocks':<28}{base.num_blocks:>18,}{quant.num_blocks:>14,}"
            f"  ({figures['capacity_ratio']:.2f}x; "
            f"{figures['capacity_ratio_vs_bfloat16']:.2f}x a bfloat16 cache's)",
            f"{'all logprobs finite':<28}{_yes(base.all_finite):>18}{_yes(quant.all_finite):>14}",
            f"greedy agreement: {agree}/{num_prompts} prompts identical for {n} tokens "
            f"({figures['greedy_agreement']:.0%}); mean tokens until first divergence "
            f"{figures['mean_tokens_until_divergence']:.1f} of {n}",
        ]
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"
