"""LiveStats: what the /dashboard page shows, as one JSON snapshot (GET /stats).

Fed on the engine thread after every step (like PrometheusMetrics), read on the event loop:
the latest engine counters, prefix-cache hit rates overall, by prompt length and by caller,
and latency percentiles over the last finished requests, split into queue, prefill and
decode time. Prometheus histograms only approximate percentiles from bucket counts; these
are exact over the window. `history` holds the last minutes as one sample every few seconds
(the dashboard's charts), so a page opened now still shows what happened before it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from pagedllm.metrics.stats import EngineTotals, PrefixCacheStats, SchedulerStats
from pagedllm.outputs import RequestOutput

WINDOW = 1000  # finished requests the percentiles cover
TOP_USERS = 10  # callers listed, by prompt tokens looked up
_PHASES = ("queue_time", "prefill_time", "decode_time", "time_to_first_token", "e2e_latency")
SAMPLE_INTERVAL_S = 2.0  # one history sample per interval ...
NUM_SAMPLES = 300  # ... for the last 10 minutes


class LiveStats:
    def __init__(
        self, model_name: str, num_blocks: int, block_size: int, clock: Callable[[], float] = time.time
    ) -> None:
        """clock: wall time in seconds, the charts' x axis (a test passes its own)."""
        self.model_name = model_name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        self._stats = SchedulerStats()
        self._prefix_cache = PrefixCacheStats().snapshot(TOP_USERS)
        self._finished: deque[dict[str, float | None]] = deque(maxlen=WINDOW)  # _PHASES -> seconds
        self._num_finished = 0
        self._clock = clock
        self._history = History(clock())

    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        finished = [{phase: getattr(o.metrics, phase) for phase in _PHASES} for o in outputs if o.finished]
        cache = stats.prefix_cache  # mutated by the scheduler: read it here, on the engine thread
        prefix_cache = self._prefix_cache
        if (cache.queries, cache.preempted_recompute_saved) != (
            prefix_cache["queries"],
            prefix_cache["preempted_recompute_saved"],
        ):  # rebuilt only on steps that admitted or resumed a request
            prefix_cache = cache.snapshot(TOP_USERS)
        ttfts = [f["time_to_first_token"] for f in finished if f["time_to_first_token"] is not None]
        with self._lock:
            self._stats, self._prefix_cache = stats, prefix_cache
            self._finished.extend(finished)
            self._num_finished += len(finished)
            self._history.record(self._clock(), stats, ttfts)

    def snapshot(self) -> dict:
        with self._lock:
            stats, prefix_cache = self._stats, self._prefix_cache
            window, num_finished = list(self._finished), self._num_finished
            history = self._history.columns(self._clock())
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
            "spec_decode": None if stats.spec_decode is None else stats.spec_decode.snapshot(),
            "latency_s": {
                phase: _percentiles([value for r in window if (value := r[phase]) is not None])
                for phase in _PHASES
            },
            "window": len(window),
            "history": history,
        }


class Sample(NamedTuple):
    """One point of the charts: rates over the interval that ends at `time`, gauges at `time`."""

    time: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    running: int
    waiting: int
    kv_cache_usage: float
    hit_rate: float | None  # None: no prompt was looked up in the interval (a gap, not a 0)
    ttft_p50: float | None  # of the requests that finished in the interval
    ttft_p95: float | None
    draft_acceptance: float | None  # share of draft tokens accepted; None: none checked


class History:
    """The last NUM_SAMPLES samples, one per SAMPLE_INTERVAL_S. Not thread-safe: LiveStats calls
    it under its lock. `record` runs after every step, so it only adds and compares until a
    sample is due."""

    def __init__(self, start: float) -> None:
        self._samples: deque[Sample] = deque(maxlen=NUM_SAMPLES)
        self._last_time = start
        self._last_counts = EngineTotals()
        self._counts = EngineTotals()
        self._gauges: tuple[int, int, float] = (0, 0, 0.0)  # running, waiting, KV cache usage
        self._ttfts: list[float] = []

    def record(self, now: float, stats: SchedulerStats, ttfts: list[float]) -> None:
        """On the engine thread (stats.prefix_cache is the scheduler's live object)."""
        self._counts = EngineTotals.of(stats)
        self._gauges = (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
        self._ttfts.extend(ttfts)
        self._sample_if_due(now)

    def columns(self, now: float) -> dict[str, list]:
        """The samples as columns (what uPlot draws); an idle engine records nothing, so reading
        takes a due sample too and the charts keep moving."""
        self._sample_if_due(now)
        return {name: [getattr(s, name) for s in self._samples] for name in Sample._fields}

    def _sample_if_due(self, now: float) -> None:
        elapsed = now - self._last_time
        if elapsed < SAMPLE_INTERVAL_S:
            return
        new = self._counts.since(self._last_counts)
        running, waiting, kv_cache_usage = self._gauges
        ttft = _percentiles(self._ttfts)
        self._samples.append(
            Sample(
                time=now,
                prompt_tokens_per_s=new.prompt_tokens_computed / elapsed,
                generation_tokens_per_s=new.generation_tokens / elapsed,
                running=running,
                waiting=waiting,
                kv_cache_usage=kv_cache_usage,
                hit_rate=new.hits / new.queries if new.queries else None,
                ttft_p50=None if ttft is None else ttft["p50"],
                ttft_p95=None if ttft is None else ttft["p95"],
                draft_acceptance=new.accepted_tokens / new.draft_tokens if new.draft_tokens else None,
            )
        )
        self._last_time, self._last_counts, self._ttfts = now, self._counts, []


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p95": cuts[94], "p99": cuts[98]}
