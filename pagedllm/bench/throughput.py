"""`pagedllm bench throughput`: the engine against static batching, in the same run.

Every request is submitted at t=0. The engine gets exactly the KV memory the static scheme
reserves (batch size x max length tokens), so the comparison is at equal memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedllm.bench.naive import NaiveHF, NaiveResult
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.logger import configure_logging
from pagedllm.model.config_reader import model_config_from_folder
from pagedllm.model.locate import resolve_dtype, resolve_model_folder
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.kv_cache import KVCacheSpec
from pagedllm.worker.worker import resolve_device
from pagedllm.workload import BenchRequest, load_requests


@dataclass
class EngineResult:
    elapsed_s: float
    requested_tokens: int
    ttft_p50_s: float
    ttft_p95_s: float
    peak_allocated_slots: int
    used_slots_at_peak: int
    num_preemptions: int

    @property
    def output_throughput(self) -> float:
        return self.requested_tokens / self.elapsed_s

    @property
    def waste_at_peak(self) -> float:
        return 1 - self.used_slots_at_peak / self.peak_allocated_slots if self.peak_allocated_slots else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", required=True, help="JSONL request set (prompt, max_tokens, ignore_eos)"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--naive-batch-size", type=int, default=8)
    parser.add_argument(
        "--naive-max-len",
        type=int,
        default=2048,
        help="tokens the static scheme reserves per slot; the engine gets batch x this",
    )
    parser.add_argument("--skip-naive", action="store_true", help="run the engine only")
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=128,
        help="tokens for the single-request decode-speed comparison (0 skips it)",
    )
    parser.add_argument("--output-json", default=None, help="write the figures here")
    add_engine_args(parser)


def run_engine(engine: LLMEngine, requests: list[BenchRequest]) -> EngineResult:
    start = time.monotonic()
    max_tokens = {}
    for i, r in enumerate(requests):
        req_id = engine.add_request(
            f"bench-{i}",
            r.prompt,
            SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos),
            arrival_time=start,
        )
        max_tokens[req_id] = r.max_tokens
    block_size = engine.config.block_size
    num_blocks = engine.facts.num_kv_blocks
    peak_allocated, used_at_peak, ttfts, generated = 0, 0, [], 0
    preemptions_before = engine.get_stats().num_preemptions
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += min(len(output.outputs[0].token_ids), max_tokens[output.request_id])
                ttfts.append(output.metrics.time_to_first_token or 0.0)
        stats = engine.get_stats()
        allocated = (num_blocks - stats.num_free_blocks) * block_size
        if allocated > peak_allocated:
            peak_allocated, used_at_peak = allocated, stats.num_used_slots
    elapsed = time.monotonic() - start
    quantiles = statistics.quantiles(ttfts, n=20) if len(ttfts) > 1 else [ttfts[0]] * 19
    return EngineResult(
        elapsed,
        generated,
        statistics.median(ttfts),
        quantiles[18],
        peak_allocated,
        used_at_peak,
        engine.get_stats().num_preemptions - preemptions_before,
    )


def engine_decode_speed(engine: LLMEngine, prompt: str, num_tokens: int) -> float:
    engine.add_request(
        "decode-speed", prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    )
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            last = output
    assert last is not None and last.metrics.first_token_time and last.metrics.last_token_time
    return (num_tokens - 1) / (last.metrics.last_token_time - last.metrics.first_token_time)


def main(args: argparse.Namespace) -> None:
    configure_logging()
    requests = load_requests(args.workload, args.num_requests)
    config = engine_config_from_args(args)
    folder = resolve_model_folder(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    spec = KVCacheSpec.for_model(
        model_config_from_folder(folder), config.block_size, str(dtype).split(".")[-1]
    )
    reserved_tokens = args.naive_batch_size * args.naive_max_len
    if config.kv_cache_memory_bytes is None and config.num_gpu_blocks_override is None:
        config = config.replace(kv_cache_memory_bytes=reserved_tokens * spec.bytes_per_token)
    if config.max_model_len is None:
        config = config.replace(max_model_len=args.naive_max_len)
    engine = LLMEngine(config)
    decode_prompt = requests[0].prompt
    engine_decode = (
        engine_decode_speed(engine, decode_prompt, args.decode_tokens) if args.decode_tokens else None
    )
    engine_result = run_engine(engine, requests)
    naive_result: NaiveResult | None = None
    naive_decode = None
    if not args.skip_naive:
        del engine
        naive = NaiveHF(folder, dtype)
        naive_decode = naive.decode_speed(decode_prompt, args.decode_tokens) if args.decode_tokens else None
        naive_result = naive.run(requests, args.naive_batch_size, args.naive_max_len)
    report = _report(args, requests, dtype, spec, engine_result, naive_result, engine_decode, naive_decode)
    print(report["text"])
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({k: v for k, v in report.items() if k != "text"}, indent=2)
        )


def _report(
    args,
    requests,
    dtype,
    spec,
    engine: EngineResult,
    naive: NaiveResult | None,
    engine_decode: float | None,
    naive_decode: float | None,
) -> dict:
    gib = spec.bytes_per_token / 2**30
    dtype_name = str(dtype).split(".")[-1]
    num_requested = sum(r.max_tokens for r in requests)
    lines = [
        f"workload: {args.workload} ({len(requests)} requests, {num_requested:,} requested output tokens), "
        f"dtype {dtype_name}, threads {torch.get_num_threads()}, git {git_sha()}",
        "",
        f"{'':<34}{'pagedllm':>14}{'naive HF':>14}{'ratio':>10}",
        _row("output tokens/s", engine.output_throughput, naive.output_throughput if naive else None),
        _row("elapsed s", engine.elapsed_s, naive.elapsed_s if naive else None, ratio=False),
    ]
    if engine_decode is not None:
        lines.append(_row("single-request decode tokens/s", engine_decode, naive_decode))
    lines += [
        "",
        f"KV memory, pagedllm: {engine.peak_allocated_slots:,} token slots allocated at the peak "
        f"({engine.peak_allocated_slots * gib:.3f} GiB), {engine.used_slots_at_peak:,} holding K/V: "
        f"waste {engine.waste_at_peak:.1%} of allocated; TTFT p50 {engine.ttft_p50_s:.2f} s, "
        f"p95 {engine.ttft_p95_s:.2f} s; {engine.num_preemptions} preemptions",
    ]
    if naive:
        lines.append(
            f"KV memory, naive: {naive.reserved_tokens:,} token slots reserved "
            f"({naive.reserved_tokens * gib:.3f} GiB), at most {naive.peak_used_tokens:,} used: "
            f"{1 - naive.peak_used_tokens / naive.reserved_tokens:.1%} of the reservation "
            "sits empty at its fullest"
        )
    return {
        "text": "\n".join(lines),
        "workload": args.workload,
        "dtype": str(dtype).split(".")[-1],
        "git": git_sha(),
        "engine": {
            **asdict(engine),
            "output_throughput": engine.output_throughput,
            "waste_at_peak": engine.waste_at_peak,
            "decode_tokens_per_s": engine_decode,
        },
        "naive": None
        if naive is None
        else {
            **asdict(naive),
            "output_throughput": naive.output_throughput,
            "decode_tokens_per_s": naive_decode,
        },
    }


def _row(name: str, ours: float, theirs: float | None, ratio: bool = True) -> str:
    their_text = f"{theirs:>14.1f}" if theirs is not None else f"{'-':>14}"
    ratio_text = f"{ours / theirs:>9.2f}x" if ratio and theirs else f"{'':>10}"
    return f"{name:<34}{ours:>14.1f}{their_text}{ratio_text}"


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
