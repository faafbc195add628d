"""`pagedllm bench kv-quant`: an 8-bit KV cache against the `auto` cache, in one run.

Four figures, each measured on both caches with the same model and flags:
- capacity: blocks at the same budget (also against a bfloat16 cache, the accelerator baseline);
- perplexity on the eval texts (pagedllm/eval/data/texts.json), teacher-forced;
- output throughput on the workload, every request submitted at t=0, at a roomy budget where
  both caches hold the whole batch (same concurrency);
- the same at a tight budget where the `auto` cache holds only --tight-fraction of the batch's
  blocks, so it must preempt, while the 8-bit cache holds about twice (or, against float32,
  four times) as much.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from pagedllm.bench.throughput import EngineResult, git_sha, run_engine
from pagedllm.config import EngineConfig, add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.eval.scoring import load_eval_set, perplexity, run_generation
from pagedllm.logger import configure_logging
from pagedllm.model.config_reader import model_config_from_folder
from pagedllm.model.locate import resolve_dtype, resolve_model_folder
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import load_tokenizer
from pagedllm.worker.kv_cache import KVCacheSpec, resolve_cache_dtype
from pagedllm.worker.worker import resolve_device
from pagedllm.workload import BenchRequest, load_requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", required=True, help="JSONL request set (prompt, max_tokens, ignore_eos)"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    parser.add_argument(
        "--tight-fraction",
        type=float,
        default=0.5,
        help="the tight budget holds this fraction of the batch's blocks in the auto cache",
    )
    parser.add_argument("--output-json", default=None, help="write the figures here")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> None:
    configure_logging()
    config = engine_config_from_args(args, disable_log_stats=True)
    quant_dtype = "int8" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    requests = load_requests(args.workload, args.num_requests)
    folder = resolve_model_folder(config.model)
    model_config = model_config_from_folder(folder)
    model_dtype = str(resolve_dtype(config.dtype, resolve_device(config.device))).removeprefix("torch.")
    tokenizer = load_tokenizer(config.tokenizer or folder, config.chat_template)
    seq_lens = [len(tokenizer(r.prompt).input_ids) + r.max_tokens for r in requests]
    config = config.replace(max_model_len=config.max_model_len or max(seq_lens))

    def spec(kv_cache_dtype: str) -> KVCacheSpec:
        cache_dtype = resolve_cache_dtype(kv_cache_dtype, model_dtype)
        return KVCacheSpec.for_model(model_config, config.block_size, cache_dtype)

    specs = {"auto": spec("auto"), "quantized": spec(quant_dtype), "bfloat16": spec("bfloat16")}
    base_spec = specs["auto"]
    batch_blocks = sum(base_spec.blocks_per_sequence(n) for n in seq_lens)
    roomy = config.kv_cache_memory_bytes or (batch_blocks + 1) * base_spec.bytes_per_block
    tight_blocks = max(int(batch_blocks * args.tight_fraction), base_spec.blocks_per_sequence(max(seq_lens)))
    budgets = {"roomy": int(roomy), "tight": tight_blocks * base_spec.bytes_per_block}

    texts = load_eval_set("texts")
    runs: dict[str, dict] = {}
    for budget_name, budget in budgets.items():
        for name, kv_cache_dtype in (("auto", "auto"), ("quantized", quant_dtype)):
            engine = LLMEngine(config.replace(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget))
            runs[f"{budget_name}/{name}"] = _measure(engine, requests, texts, budget_name == "roomy")
            del engine
            gc.collect()  # one engine's KV cache at a time
    report = _report(args, config, len(requests), model_dtype, specs, budgets, batch_blocks, runs)
    print(report.pop("text"))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


def _measure(engine: LLMEngine, requests: list[BenchRequest], texts: list[str], score: bool) -> dict:
    """Perplexity (when `score`), then the timed workload after a short warm-up."""
    figures: dict = {"num_blocks": engine.facts.num_kv_blocks}
    if score:
        figures["perplexity"], figures["num_scored_tokens"], figures["all_finite"] = perplexity(engine, texts)
    run_generation(engine, [requests[0].prompt], SamplingParams(temperature=0.0, max_tokens=4))
    engine.reset_prefix_cache()  # the warm-up must not give the timed run a prefix hit
    before = engine.get_stats()
    computed_before, saved_before = (
        before.num_prompt_tokens_computed,
        before.prefix_cache.preempted_recompute_saved,
    )
    result: EngineResult = run_engine(engine, requests)
    after = engine.get_stats()
    figures.update(
        output_throughput=result.output_throughput,
        elapsed_s=result.elapsed_s,
        num_preemptions=result.num_preemptions,
        ttft_p50_s=result.ttft_p50_s,
        prompt_tokens_computed=after.num_prompt_tokens_computed - computed_before,
        # a preempted request's own blocks, still cached when it resumed: recompute it was spared
        recompute_saved_tokens=after.prefix_cache.preempted_recompute_saved - saved_before,
    )
    return figures


def _report(
    args, config: EngineConfig, num_requests: int, model_dtype: str, specs: dict, budgets, batch_blocks, runs
) -> dict:
    base, quant, bfloat16 = specs["auto"], specs["quantized"], specs["bfloat16"]
    roomy_budget = budgets["roomy"]
    capacity = {
        "budget_bytes": roomy_budget,
        "auto_blocks": base.num_blocks_for(roomy_budget),
        "quantized_blocks": quant.num_blocks_for(roomy_budget),
        "bfloat16_blocks": bfloat16.num_blocks_for(roomy_budget),
    }
    capacity["ratio_vs_auto"] = capacity["quantized_blocks"] / capacity["auto_blocks"]
    capacity["ratio_vs_bfloat16"] = capacity["quantized_blocks"] / capacity["bfloat16_blocks"]
    rb, rq = runs["roomy/auto"], runs["roomy/quantized"]
    lines = [
        f"workload {args.workload} ({num_requests} requests), model dtype {model_dtype}, "
        f"auto cache {base.cache_dtype} vs {quant.cache_dtype}, threads {torch.get_num_threads()}, "
        f"git {git_sha()}, {time.strftime('%Y-%m-%d')}",
        f"capacity at {roomy_budget / 2**30:.3f} GiB: {capacity['auto_blocks']:,} vs "
        f"{capacity['quantized_blocks']:,} blocks = {capacity['ratio_vs_auto']:.2f}x "
        f"(a bfloat16 cache: {capacity['bfloat16_blocks']:,} blocks, {capacity['ratio_vs_bfloat16']:.2f}x)",
        f"perplexity ({rq['num_scored_tokens']:,} tokens): {rb['perplexity']:.4f} vs {rq['perplexity']:.4f} "
        f"({rq['perplexity'] / rb['perplexity'] - 1:+.2%}); "
        f"all logprobs finite: {rb['all_finite'] and rq['all_finite']}",
        _throughput_line("same concurrency, both hold the batch", roomy_budget, rb, rq),
        _throughput_line(
            f"tight: auto holds {args.tight_fraction:.0%} of the batch's {batch_blocks:,} blocks",
            budgets["tight"],
            runs["tight/auto"],
            runs["tight/quantized"],
        ),
    ]
    return {
        "text": "\n".join(lines),
        "workload": args.workload,
        "num_requests": num_requests,
        "model": config.model,
        "model_dtype": model_dtype,
        "kv_cache_dtype": quant.cache_dtype,
        "git": git_sha(),
        "threads": torch.get_num_threads(),
        "capacity": capacity,
        "budgets_bytes": budgets,
        "runs": runs,
    }


def _throughput_line(label: str, budget: int, base: dict, quant: dict) -> str:
    return (
        f"output tokens/s, {label} ({budget / 2**30:.3f} GiB): {base['output_throughput']:.1f} vs "
        f"{quant['output_throughput']:.1f} = {quant['output_throughput'] / base['output_throughput']:.2f}x; "
        f"preemptions {base['num_preemptions']} vs {quant['num_preemptions']}; prompt tokens computed "
        f"{base['prompt_tokens_computed']:,} vs {quant['prompt_tokens_computed']:,} (found again in the "
        f"prefix cache after preemption: {base['recompute_saved_tokens']:,} vs "
        f"{quant['recompute_saved_tokens']:,})"
    )
