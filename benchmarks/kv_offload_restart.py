"""Time to first token of the first requests after a restart: warm (the disk tier written at the
last shutdown) vs cold (an empty cache), in one run.

    .venv/bin/python benchmarks/kv_offload_restart.py --workload ../shared/workloads/shared_prefix.jsonl

An engine with --kv-offload-dir serves the whole workload and shuts down (writing its cached
blocks); then a new engine on the same directory and a new engine without one each get the
workload's first requests one at a time, and each request's TTFT is measured (one output token).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.workload import load_requests


def ttfts(llm: LLM, prompts: list[str]) -> tuple[list[float], list[int]]:
    seconds, cached = [], []
    for prompt in prompts:
        start = time.perf_counter()
        [output] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        cached.append(output.num_cached_tokens)
    return seconds, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="../shared/workloads/shared_prefix.jsonl")
    parser.add_argument("--first", type=int, default=8, help="requests timed after the restart")
    args = parser.parse_args()
    requests = load_requests(args.workload)
    prompts = [r.prompt for r in requests]
    common = dict(max_model_len=4096, kv_cache_memory_bytes="1GiB", disable_log_stats=True)
    with tempfile.TemporaryDirectory() as directory:
        before = LLM(**common, kv_offload_dir=directory)
        before.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        before.llm_engine.close()
        del before
        warm = LLM(**common, kv_offload_dir=directory)
        warm_s, warm_cached = ttfts(warm, prompts[: args.first])
        del warm
    cold = LLM(**common)
    cold_s, cold_cached = ttfts(cold, prompts[: args.first])
    print(f"host: {describe_host()}; git {git_sha()}")
    print(f"the first {args.first} requests of {args.workload} after a restart, one at a time")
    print("request  cold TTFT ms (cached tokens)  warm TTFT ms (cached tokens)")
    for i, (c, w, cc, wc) in enumerate(zip(cold_s, warm_s, cold_cached, warm_cached, strict=True)):
        print(f"{i:7}  {c * 1e3:12.1f} ({cc:5})            {w * 1e3:12.1f} ({wc:5})")
    print(f"first request: cold / warm = {cold_s[0] / warm_s[0]:.2f}x")
    ratio = statistics.median(cold_s) / statistics.median(warm_s)
    print(f"median of the first {args.first}: cold / warm = {ratio:.2f}x")


if __name__ == "__main__":
    main()
