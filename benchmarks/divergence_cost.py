"""What the prefix divergence finder costs: throughput on a workload with it on vs off (one
process, two engines, runs alternated), and its own time per prompt (observe on the engine thread,
analyse on /stats).

    .venv/bin/python benchmarks/divergence_cost.py --workload ../shared/workloads/mixed.jsonl
"""

from __future__ import annotations

import argparse
import time

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.workload import load_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="../shared/workloads/mixed.jsonl")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    requests = load_requests(args.workload)
    prompts = [r.prompt for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    common = dict(max_num_seqs=32, kv_cache_memory_bytes="1GiB", max_model_len=4096, disable_log_stats=True)
    engines = {"finder on": LLM(**common), "finder off": LLM(**common, divergence_finder_tokens=0)}
    for llm in engines.values():
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm up
    totals = {name: [0.0, 0] for name in engines}
    for round_index in range(args.rounds):
        order = list(engines.items())
        for name, llm in order if round_index % 2 == 0 else order[::-1]:  # ABBA: no order bias
            llm.llm_engine.reset_prefix_cache()  # each run starts cold, as the other did
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += sum(len(o.outputs[0].token_ids) for o in outputs)
    finder = engines["finder on"].llm_engine.core.divergence
    start = time.perf_counter()
    groups = finder.report()
    analyse_s = time.perf_counter() - start
    print(f"host: {describe_host()}; git {git_sha()}")
    print(f"{len(prompts)} requests of {args.workload}, {args.rounds} runs each, alternated A B B A")
    rates = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    for name, rate in rates.items():
        print(f"  {name:10} {rate:7.1f} output tokens/s")
    print(f"finder on / off: {rates['finder on'] / rates['finder off']:.3f}x")
    kept = finder.num_prompts
    print(f"report() after the runs: {analyse_s * 1e3:.1f} ms, {len(groups)} groups, {kept} prompts kept")


if __name__ == "__main__":
    main()
