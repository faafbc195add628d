"""LiveStats on its own: percentiles over the window of finished requests, hit-rate rows, history."""

from __future__ import annotations

import statistics

import pytest

from pagedllm.metrics.live_stats import NUM_SAMPLES, SAMPLE_INTERVAL_S, WINDOW, LiveStats
from pagedllm.metrics.stats import PrefixCacheStats, SchedulerStats
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


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


def test_history_samples_rates_gauges_and_ttft_per_interval():
    now = [1000.0]
    live = LiveStats("m", num_blocks=10, block_size=16, clock=lambda: now[0])
    cache = PrefixCacheStats()
    live.record(SchedulerStats(prefix_cache=cache), [])
    assert live.snapshot()["history"]["time"] == []  # no interval has passed yet
    now[0] = 1002.0
    cache.record("alice", 100, 64)
    stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=1,
        kv_cache_usage=0.5,
        num_prompt_tokens_computed=36,
        num_generation_tokens=10,
        prefix_cache=cache,
    )
    live.record(stats, [_finished("a", 0.5, 1.0, 2.0), _finished("b", 0.5, 3.0, 2.0)])
    history = live.snapshot()["history"]
    assert history == {
        "time": [1002.0],
        "prompt_tokens_per_s": [18.0],
        "generation_tokens_per_s": [5.0],
        "running": [3],
        "waiting": [1],
        "kv_cache_usage": [0.5],
        "hit_rate": [0.64],
        "ttft_p50": [2.5],
        "ttft_p95": [pytest.approx(3.4)],
        "draft_acceptance": [None],  # no speculative decoding: no drafts checked
    }
    now[0] = 1005.0  # an idle engine records nothing: reading takes the due sample
    history = live.snapshot()["history"]
    assert history["time"] == [1002.0, 1005.0] and history["generation_tokens_per_s"][1] == 0.0
    assert history["hit_rate"][1] is None and history["ttft_p50"][1] is None and history["running"][1] == 3


def test_history_keeps_the_last_samples():
    now = [0.0]
    live = LiveStats("m", num_blocks=10, block_size=16, clock=lambda: now[0])
    for _ in range(NUM_SAMPLES + 5):
        now[0] += SAMPLE_INTERVAL_S
        live.record(SchedulerStats(), [])
    times = live.snapshot()["history"]["time"]
    assert len(times) == NUM_SAMPLES and times[-1] == now[0]
