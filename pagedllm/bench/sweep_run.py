"""One setting of `pagedllm bench sweep`, in its own process: replays the sweep's requests (a
single-turn JSONL file the sweep wrote) and prints one JSON line of results."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedllm.bench.arrivals import arrival_times
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.workload import load_requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--setting", required=True, help="engine flags as JSON")
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    args = parser.parse_args()
    requests = load_requests(args.workload)
    engine = LLMEngine(EngineConfig(**{"disable_log_stats": True, **json.loads(args.setting)}))
    engine.add_request("warm-up", "Hello", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()

    arrivals = arrival_times(len(requests), args.request_rate)  # Poisson; inf: everything at t=0
    start = time.monotonic()
    outputs, peak_usage, next_request = {}, 0.0, 0
    while next_request < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while next_request < len(requests) and arrivals[next_request] <= now:
            r = requests[next_request]
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
            engine.add_request(
                str(next_request), r.prompt, params, arrival_time=start + arrivals[next_request]
            )
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - now))
            continue
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        peak_usage = max(peak_usage, engine.get_stats().kv_cache_usage)
    elapsed = time.monotonic() - start
    stats = engine.get_stats()
    ttfts = [ttft for o in outputs.values() if (ttft := o.metrics.time_to_first_token) is not None]
    tpots = [
        decode_time / (len(o.outputs[0].token_ids) - 1)
        for o in outputs.values()
        if len(o.outputs[0].token_ids) > 1 and (decode_time := o.metrics.decode_time) is not None
    ]
    result = {
        "output_throughput": sum(len(o.outputs[0].token_ids) for o in outputs.values()) / elapsed,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": _p95(ttfts),
        "tpot_p50_s": statistics.median(tpots) if tpots else 0.0,
        "hit_rate": stats.prefix_cache.hit_rate,
        "preemptions": stats.num_preemptions,
        "peak_kv_usage": peak_usage,
        "elapsed_s": elapsed,
    }
    print(json.dumps(result))


def _p95(values: list[float]) -> float:
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=100, method="inclusive")[94]


if __name__ == "__main__":
    main()
