"""`pagedllm plan`: KV cache capacity from a model's config, before buying or tuning hardware."""

from __future__ import annotations

import argparse
import json
from typing import get_args

from pagedllm.config import DType, KVCacheDType, Quantization, parse_memory_size
from pagedllm.model.errors import ModelLoadError
from pagedllm.model.locate import locate_model, model_display_name
from pagedllm.model_loader import check_quantization, checkpoint_quantization
from pagedllm.planner import (
    WHAT_IF_KV_CACHE_DTYPES,
    CapacityPlan,
    MemoryBudget,
    config_from_numbers,
    fits,
    plan_capacity,
    read_model_config,
)

_NUMBERS = ("hidden_size", "num_heads", "intermediate_size", "vocab_size")


def register(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.set_defaults(handler=run, parser=parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder, GGUF file or hub name ORG/NAME (default: the default model)"
    )
    parser.add_argument("--revision", default=None, help="hub model: branch, tag or commit")
    parser.add_argument("--download-dir", default=None, help="hub model: the cache folder to read or fill")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--kv-cache-dtype", choices=get_args(KVCacheDType), default="auto")
    parser.add_argument("--block-size", type=int, default=16, choices=[2**i for i in range(9)])
    parser.add_argument("--dtype", choices=get_args(DType), default="auto", help="weights dtype")
    parser.add_argument(
        "--quantization",
        choices=get_args(Quantization),
        default=None,
        help="as serve's: left out, a GGUF's own formats; int8/int4 quantize a float checkpoint's "
        "projections; none dequantizes to --dtype",
    )
    parser.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="a prefix every request shares (a fixed system prompt), cached once: the concurrency it allows",
    )
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-memory-bytes", type=parse_memory_size, default=None, help="e.g. 1GiB")
    memory.add_argument(
        "--device-memory", type=parse_memory_size, default=None, help="device memory, e.g. 24GB or 80GiB"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--overhead-bytes",
        type=parse_memory_size,
        default=0,
        help="with --device-memory: activations and CUDA context, which the engine measures (e.g. 0.5GB)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is split over: weights, budget and cache are then one rank's",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    numbers = parser.add_argument_group("model by numbers (instead of --model)")
    numbers.add_argument("--layers", type=int, default=None)
    numbers.add_argument("--hidden-size", type=int, default=None)
    numbers.add_argument("--num-heads", type=int, default=None)
    numbers.add_argument("--num-kv-heads", type=int, default=None, help="default: --num-heads")
    numbers.add_argument("--head-dim", type=int, default=None, help="default: hidden size / heads")
    numbers.add_argument("--intermediate-size", type=int, default=None)
    numbers.add_argument("--vocab-size", type=int, default=None)
    numbers.add_argument("--max-position-embeddings", type=int, default=4096)
    numbers.add_argument("--tie-word-embeddings", action="store_true")


def run(args: argparse.Namespace) -> None:
    try:
        plan = build_plan(args)
    except ModelLoadError as error:  # a damaged or absurd model: what serve would answer
        args.parser.exit(1, f"error: {error}\n")
    except (ValueError, FileNotFoundError) as error:
        args.parser.exit(2, f"pagedllm plan: error: {error}\n")
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))


def build_plan(args: argparse.Namespace) -> CapacityPlan:
    gguf_path, checkpoint = None, None
    if args.layers is None:
        config = read_model_config(args.model, revision=args.revision, download_dir=args.download_dir)
        name = model_display_name(args.model)
        path = locate_model(args.model, revision=args.revision, download_dir=args.download_dir, weights=False)
        gguf_path = path if path.suffix == ".gguf" else None
        checkpoint = checkpoint_quantization(path) if gguf_path is None else None
        own_method = checkpoint.method if checkpoint else None
        check_quantization(args.quantization, is_gguf=gguf_path is not None, checkpoint_method=own_method)
    elif args.model is not None:
        raise ValueError("give --model or the model by numbers (--layers ...), not both")
    else:
        missing = [f"--{n.replace('_', '-')}" for n in _NUMBERS if getattr(args, n) is None]
        if missing:
            raise ValueError(f"a model by numbers also needs {', '.join(missing)}")
        config = config_from_numbers(
            layers=args.layers,
            hidden_size=args.hidden_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            max_position_embeddings=args.max_position_embeddings,
            tie_word_embeddings=args.tie_word_embeddings,
        )
        name = "a model given by numbers"
    budget = MemoryBudget(
        args.kv_cache_memory_bytes, args.device_memory, args.gpu_memory_utilization, args.overhead_bytes
    )
    return plan_capacity(
        config,
        name,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        budget=budget,
        quantization=args.quantization,
        gguf_path=gguf_path,
        checkpoint=checkpoint,
        shared_prefix_tokens=args.shared_prefix_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def format_plan(plan: CapacityPlan) -> str:
    c, kv, spec, budget = plan.model_config, plan.kv, plan.kv.spec, plan.budget
    tp = plan.tensor_parallel_size
    per_rank = f" per rank (of {tp})" if tp > 1 else ""
    element = f"{spec.element_bytes} byte{'s' if spec.element_bytes > 1 else ''}"
    row = f"{c.head_dim} x {element}" + (" + 2 scale bytes" if spec.is_quantized else "")
    scales = spec.scale_bytes_per_token
    scale_share = f"; scales {scales:,} ({scales / spec.bytes_per_token:.1%})" if scales else ""
    lines = [
        f"model            {plan.model_name} ({c.architecture})",
        f"shape            {c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
        f"{c.num_key_value_heads} KV heads, head_dim {c.head_dim}, context {c.max_position_embeddings:,}",
        f"weights          {plan.num_parameters:,} parameters = {_size(plan.weights_bytes)}{per_rank} ("
        + ", ".join(
            f"{name} {size / 2**30:.2f} GiB"
            for name, size in sorted(plan.weights_by_format.items(), key=lambda i: -i[1])
        )
        + f"; activations {plan.dtype})",
        *_experts_line(plan),
        f"KV cache dtype   {spec.cache_dtype}",
        f"bytes per token  {spec.bytes_per_token:,} = 2 x {c.num_hidden_layers} layers x "
        f"{spec.num_kv_heads} KV heads x ({row}){scale_share}{per_rank}",
        f"KV budget        {_size(kv.budget_bytes)}{_budget_source(plan)}{per_rank}",
        f"blocks           {kv.num_blocks:,} of {spec.block_size} tokens = {_size(kv.allocated_bytes)}"
        + (f" per rank; {_size(kv.allocated_bytes * tp)} over {tp} ranks" if tp > 1 else ""),
        f"tokens           {kv.num_tokens:,}",
        f"max concurrency  {kv.max_concurrency:.2f} requests of {kv.max_model_len:,} tokens"
        + ("" if fits(kv) else "  (not one fits: the engine would refuse to start)"),
    ]
    if plan.shared_prefix_tokens:
        lines.append(
            f"                 {plan.max_concurrency_with_shared_prefix:.2f} when their first "
            f"{plan.shared_prefix_tokens:,} tokens are one shared prefix, cached once"
        )
    if (
        budget.device_memory_bytes is not None
        and budget.kv_cache_memory_bytes is None
        and not budget.overhead_bytes
    ):
        lines.append(
            "                 (before runtime overhead: activations and CUDA context, which the engine "
            "measures at start-up; --overhead-bytes takes them off)"
        )
    lines += ["", *_what_if_table(plan)]
    return "\n".join(lines)


def _experts_line(plan: CapacityPlan) -> list[str]:
    """A mixture of experts' parameters a token uses: what a decode step reads of the experts."""
    c = plan.model_config
    if c.num_experts is None:
        return []
    return [
        f"active           {plan.active_parameters:,} parameters a token ({c.num_experts_per_tok} of "
        f"{c.num_experts} experts on {c.num_sparse_layers} of {c.num_hidden_layers} layers: "
        f"{plan.active_parameters / plan.num_parameters:.1%} of the weights' parameters)",
        f"decode reads     about {_size(plan.decode_step_weight_bytes)} of the weights a step for one "
        "request (a step of many: each expert they chose, once)",
    ]


def _what_if_table(plan: CapacityPlan) -> list[str]:
    width = len(WHAT_IF_KV_CACHE_DTYPES)
    header_plans = plan.what_if[:width]
    names = [
        f"{p.spec.cache_dtype} (auto)" if d == "auto" else d
        for d, p in zip(WHAT_IF_KV_CACHE_DTYPES, header_plans, strict=True)
    ]
    lines = [
        "what if: requests of max_model_len that fit at once",
        f"{'max_model_len':<16}" + "".join(f"{n:>18}" for n in names),
        f"{'(tokens)':<16}" + "".join(f"{p.num_tokens:>18,}" for p in header_plans),
    ]
    for i in range(0, len(plan.what_if), width):
        row = plan.what_if[i : i + width]
        cells = [f"{p.max_concurrency:.2f}" if fits(p) else "does not fit" for p in row]
        lines.append(f"{row[0].max_model_len:<16,}" + "".join(f"{cell:>18}" for cell in cells))
    return lines


def _budget_source(plan: CapacityPlan) -> str:
    budget = plan.budget
    if budget.kv_cache_memory_bytes is not None:
        return " (--kv-cache-memory-bytes)"
    if budget.device_memory_bytes is None:
        return " (the CPU default; set --kv-cache-memory-bytes or --device-memory)"
    overhead = f" - {budget.overhead_bytes / 1e9:.2f} GB overhead" if budget.overhead_bytes else ""
    return (
        f" = {budget.device_memory_bytes / 1e9:.2f} GB x {budget.gpu_memory_utilization}"
        f" - {plan.weights_bytes / 1e9:.2f} GB weights{overhead}"
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB ({num_bytes / 2**30:.2f} GiB)"
