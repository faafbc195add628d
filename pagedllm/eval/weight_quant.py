"""`pagedllm eval weight-quant`: what quantized weights cost in quality, against the same weights
dequantized, before a user goes live with them.

The reference is the model with every weight dequantized to --dtype (`--quantization none`): for a
GGUF or a quantized checkpoint the file's own values, exactly. Against it, each format: a GGUF's
own blocks or an AWQ / GPTQ / compressed-tensors / FP8 checkpoint as served (the default for
those), a float checkpoint quantized at load with int8 and int4. Each runs the fixed texts and
prompts of eval/data/ (the same as `eval kv-quant`): perplexity teacher-forced through the paged
path, greedy agreement over N tokens, the weights' resident bytes. One table, one row per format.
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
from pagedllm.model.locate import locate_model
from pagedllm.quantization.registry import (
    LOAD_TIME_METHODS,
    QUANTIZATION_METHODS,
    read_checkpoint_quantization,
)
from pagedllm.sampling_params import SamplingParams

_EVAL_MAX_MODEL_LEN = 2048
_EVAL_KV_CACHE_BYTES = 1 << 30


@dataclass
class WeightsRun:
    """One engine's figures on the eval set."""

    quantization: str
    weights_bytes: int
    weights_by_format: dict[str, int]
    perplexity: float
    num_scored_tokens: int
    greedy_token_ids: list[list[int]]
    all_finite: bool


def run_weights(
    config: EngineConfig, label: str, texts: list[str], prompts: list[str], max_tokens: int
) -> WeightsRun:
    engine = LLMEngine(config)
    try:
        ppl, num_scored, finite = perplexity(engine, texts)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = run_generation(engine, prompts, params)
        by_format = engine.core.worker.weights_bytes_by_format()
        return WeightsRun(
            quantization=label,
            weights_bytes=sum(by_format.values()),
            weights_by_format=by_format,
            perplexity=ppl,
            num_scored_tokens=num_scored,
            greedy_token_ids=[o.outputs[0].token_ids for o in outputs],
            all_finite=finite and math.isfinite(ppl),
        )
    finally:
        engine.close()


def compare(base: WeightsRun, run: WeightsRun, max_tokens: int) -> dict:
    divergence = [
        tokens_until_divergence(a, b)
        for a, b in zip(base.greedy_token_ids, run.greedy_token_ids, strict=True)
    ]
    return {
        "quantization": run.quantization,
        "perplexity": run.perplexity,
        "perplexity_relative_diff": run.perplexity / base.perplexity - 1,
        "greedy_agreement": sum(d == max_tokens for d in divergence) / len(divergence),
        "mean_tokens_until_divergence": sum(divergence) / len(divergence),
        "weights_bytes": run.weights_bytes,
        "weights_ratio": run.weights_bytes / base.weights_bytes,
        "all_finite": run.all_finite,
    }


def formats_to_check(config: EngineConfig, asked: list[str] | None) -> list[str]:
    """--formats as given; else the weights as stored (a GGUF's blocks: `gguf`; a quantized
    checkpoint: its method), a float checkpoint's int8 and int4."""
    if asked:
        return asked
    path = locate_model(config.model, revision=config.revision, download_dir=config.download_dir)
    if path.suffix == ".gguf":
        return ["gguf"]
    checkpoint = read_checkpoint_quantization(path)
    return [checkpoint.method] if checkpoint else list(LOAD_TIME_METHODS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=[name for name in QUANTIZATION_METHODS if name != "none"],
        default=None,
        help="the formats to check (default: a GGUF's or a quantized checkpoint's own; int8 and int4 "
        "for a float checkpoint)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> None:
    configure_logging()
    config = engine_config_from_args(args, disable_log_stats=True)
    if config.max_model_len is None:
        config = config.replace(max_model_len=_EVAL_MAX_MODEL_LEN)
    if config.kv_cache_memory_bytes is None and config.num_gpu_blocks_override is None:
        config = config.replace(kv_cache_memory_bytes=_EVAL_KV_CACHE_BYTES)
    texts, prompts = load_eval_set("texts"), load_eval_set("prompts")
    base = run_weights(config.replace(quantization="none"), "none", texts, prompts, args.max_tokens)
    rows = []
    for fmt in formats_to_check(config, args.formats):
        gc.collect()  # one engine's weights and cache at a time
        run = run_weights(config.replace(quantization=fmt), fmt, texts, prompts, args.max_tokens)
        rows.append(compare(base, run, args.max_tokens))
    if args.json:
        reference = {k: v for k, v in asdict(base).items() if k != "greedy_token_ids"}
        print(json.dumps({"model": config.model, "reference": reference, "formats": rows}, indent=2))
        return
    print(format_report(base, rows, args.max_tokens, len(prompts)))


def format_report(base: WeightsRun, rows: list[dict], max_tokens: int, num_prompts: int) -> str:
    width = max(10, *(len(row["quantization"]) + 2 for row in rows))  # compressed-tensors is long
    lines = [
        f"{'weights':<{width}}{'perplexity':>12}{'vs none':>10}{'greedy same':>13}{'tokens to part':>16}"
        f"{'GiB':>8}{'finite':>8}",
        f"{'none':<{width}}{base.perplexity:>12.4f}{'':>10}{'':>13}{'':>16}"
        f"{base.weights_bytes / 2**30:>8.3f}{'yes' if base.all_finite else 'NO':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['quantization']:<{width}}{row['perplexity']:>12.4f}{row['perplexity_relative_diff']:>+10.2%}"
            f"{round(row['greedy_agreement'] * num_prompts):>9}/{num_prompts:<3}"
            f"{row['mean_tokens_until_divergence']:>16.1f}{row['weights_bytes'] / 2**30:>8.3f}"
            f"{'yes' if row['all_finite'] else 'NO':>8}"
        )
    lines.append(
        f"(greedy: prompts identical for {max_tokens} tokens; tokens to part: mean tokens before the "
        f"first difference; weights: resident bytes, base dequantized to the run's dtype)"
    )
    return "\n".join(lines)
