"""LiveStats: what the /dashboard page shows, as one JSON snapshot (GET /stats).

Fed on the engine thread after every step (like PrometheusMetrics), read on the event loop:
the latest engine counters, prefix-cache hit rates overall, by prompt length and by caller,
and latency percentiles over the last finished requests, split into queue, prefill and
decode time. Prometheus histograms only approximate percentiles from bucket counts; these
are exact over the window.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

from pagedllm.metrics.stats import HitCounts, SchedulerStats
from pagedllm.outputs import RequestOutput

WINDOW = 1000  # finished requests the percentiles cover
TOP_USERS = 10  # callers listed, by prompt tokens looked up
_PHASES = ("queue_time", "prefill_time", "decode_time", "time_to_first_token", "e2e_latency")


class LiveStats:
    def __init__(self, model_name: str, num_blocks: int, block_size: int) -> None:
        self.model_name = model_name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        self._stats = SchedulerStats()
        self._prefix_cache: dict = {
            **_hits(HitCounts()),
            "preempted_recompute_saved": 0,
            "by_prompt_length": {},
            "by_user": {},
        }
        self._finished: deque[dict[str, float | None]] = deque(maxlen=WINDOW)  # _PHASES -> seconds
        self._num_finished = 0

    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        finished = [{phase: getattr(o.metrics, phase) for phase in _PHASES} for o in outputs if o.finished]
        cache = stats.prefix_cache  # mutated by the scheduler: read it here, on the engine thread
        prefix_cache = self._prefix_cache
        if (cache.queries, cache.preempted_recompute_saved) != (
            prefix_cache["queries"],
            prefix_cache["preempted_recompute_saved"],
        ):  # rebuilt only on steps that admitted or resumed a request
            top_users = sorted(cache.by_user.items(), key=lambda item: -item[1].queries)[:TOP_USERS]
            prefix_cache = {
                **_hits(cache),
                "preempted_recompute_saved": cache.preempted_recompute_saved,
                "by_prompt_length": {b: _hits(c) for b, c in sorted(cache.by_prompt_length.items())},
                "by_user": {user: _hits(c) for user, c in top_users},
            }
        with self._lock:
            self._stats, self._prefix_cache = stats, prefix_cache
            self._finished.extend(finished)
            self._num_finished += len(finished)

    def snapshot(self) -> dict:
        with self._lock:
            stats, prefix_cache = self._stats, self._prefix_cache
            window, num_finished = list(self._finished), self._num_finished
        return {
            "model": self.model_name,
            "running": stats.num_running_reqs,
            "waiting": stats.num_waiting_reqs,
            "finished": num_finished,
            "kv_cache": {
                "usage": stats.kv_cache_usage,
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "free_blocks": stats.num_free_blocks,
                "cached_blocks": stats.num_cached_blocks,  # findable by hash, held or free
                "used_token_slots": stats.num_used_slots,
            },
            "preemptions": stats.num_preemptions,
            "prompt_tokens_computed": stats.num_prompt_tokens_computed,
            "generation_tokens": stats.num_generation_tokens,
            "prefix_cache": prefix_cache,
            "latency_s": {
                phase: _percentiles([r[phase] for r in window if r[phase] is not None]) for phase in _PHASES
            },
            "window": len(window),
        }


def _hits(counts: HitCounts) -> dict:
    return {
        "requests": counts.requests,
        "queries": counts.queries,
        "hits": counts.hits,
        "hit_rate": counts.hit_rate,
    }


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p95": cuts[94], "p99": cuts[98]}
