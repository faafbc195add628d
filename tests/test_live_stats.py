"""LiveStats on its own: percentiles over the window of finished requests, hit-rate rows."""

from __future__ import annotations

import statistics

import pytest

from pagedllm.metrics.live_stats import WINDOW, LiveStats
from pagedllm.metrics.stats import PrefixCacheStats, SchedulerStats
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.request import RequestMetrics


def _finished(req_id: str, queue_s: float, prefill_s: float, decode_s: float) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, queued_time=0.0, first_scheduled_time=queue_s)
    metrics.first_token_time = queue_s + prefill_s
    metrics.last_token_time = metrics.finished_time = queue_s + prefill_s + decode_s
    completion = CompletionOutput(0, "ab", [1, 2], finish_reason="length")
    return RequestOutput(req_id, "p", [5, 6, 7], [completion], True, metrics, 0)


def test_percentiles_cover_the_last_window_of_requests():
    live = LiveStats("m", num_blocks=10, block_size=16)
    cache = PrefixCacheStats()
    cache.record("alice", 600, 512)
    live.record(SchedulerStats(prefix_cache=cache), [_finished("old", 100.0, 100.0, 100.0)])
    queue_times = [i / 100 for i in range(WINDOW)]  # pushes the old request out of the window
    live.record(
        SchedulerStats(prefix_cache=cache),
        [_finished(str(i), q, 0.5, 2.0) for i, q in enumerate(queue_times)],
    )
    snapshot = live.snapshot()
    assert snapshot["finished"] == WINDOW + 1 and snapshot["window"] == WINDOW
    cuts = statistics.quantiles(queue_times, n=100, method="inclusive")
    assert snapshot["latency_s"]["queue_time"] == {
        "p50": statistics.median(queue_times),
        "p95": cuts[94],
        "p99": cuts[98],
    }
    assert snapshot["latency_s"]["decode_time"]["p99"] == pytest.approx(2.0)
    assert snapshot["prefix_cache"]["by_user"]["alice"]["hit_rate"] == 512 / 600
    assert snapshot["prefix_cache"]["by_prompt_length"]["512-2047"]["hits"] == 512
