"""PrometheusMetrics on its own: vLLM's names under either prefix, counters from the engine's
running totals, histograms from a request's timestamps."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.metrics.prometheus import PrometheusMetrics, token_buckets
from pagedllm.metrics.stats import MAX_TRACKED_USERS, NO_USER, OTHER_USERS, PrefixCacheStats, SchedulerStats
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.request import RequestMetrics


def _samples(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def _output(metrics: RequestMetrics, num_tokens: int, finish_reason: str | None) -> RequestOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), finish_reason=finish_reason)
    return RequestOutput("r", "p", [1, 2, 3], [completion], finish_reason is not None, metrics, 0)


def test_vllm_prefix_names_and_values():
    metrics = PrometheusMetrics(
        "m", prefix="vllm", max_model_len=100, cache_config={"block_size": "16", "num_gpu_blocks": "9"}
    )
    times = RequestMetrics(arrival_time=10.0, queued_time=10.0, first_scheduled_time=10.5)
    times.first_token_time = times.last_token_time = 11.0
    metrics.record(
        SchedulerStats(
            num_running_reqs=1,
            kv_cache_usage=0.25,
            num_generation_tokens=1,
            prefix_cache=PrefixCacheStats(requests=1, queries=3, hits=0),
        ),
        [_output(times, 1, None)],
    )
    times.last_token_time = 11.2
    times.finished_time = 11.2
    metrics.record(
        SchedulerStats(num_generation_tokens=2, prefix_cache=PrefixCacheStats(requests=1, queries=3, hits=0)),
        [_output(times, 2, "length")],
    )
    samples = _samples(metrics)
    label = (("model_name", "m"),)
    assert all(name.startswith("vllm:") for name, _ in samples)
    assert samples[("vllm:num_requests_running", label)] == 0
    assert samples[("vllm:generation_tokens_total", label)] == 2
    assert samples[("vllm:prompt_tokens_total", label)] == 3  # counted once, at the first token
    assert samples[("vllm:prefix_cache_queries_total", label)] == 3
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *label))] == 1
    assert samples[("vllm:time_to_first_token_seconds_sum", label)] == pytest.approx(1.0)
    assert samples[("vllm:inter_token_latency_seconds_sum", label)] == pytest.approx(0.2)
    assert samples[("vllm:e2e_request_latency_seconds_sum", label)] == pytest.approx(1.2)
    assert samples[("vllm:request_queue_time_seconds_sum", label)] == pytest.approx(0.5)
    assert samples[("vllm:request_prefill_time_seconds_sum", label)] == pytest.approx(0.5)
    assert samples[("vllm:request_generation_tokens_sum", label)] == 2
    info = (("block_size", "16"), ("model_name", "m"), ("num_gpu_blocks", "9"))
    assert samples[("vllm:cache_config_info", info)] == 1


def test_hit_rates_by_prompt_length_and_by_caller_with_bounded_callers():
    metrics = PrometheusMetrics("m", max_model_len=100, cache_config={})
    cache = PrefixCacheStats()
    cache.record("alice", 600, 512)
    cache.record(None, 40, 0)
    metrics.record(SchedulerStats(prefix_cache=cache), [])
    cache.record("alice", 600, 512)
    for i in range(MAX_TRACKED_USERS + 5):  # more callers than are tracked by name
        cache.record(f"user-{i}", 10, 0)
    metrics.record(SchedulerStats(prefix_cache=cache), [])
    samples = _samples(metrics)

    def count(kind: str, label: str, value: str) -> float:
        return samples[
            (f"pagedllm:prefix_cache_{kind}_by_{label}_total", (("model_name", "m"), (label, value)))
        ]

    assert (count("queries", "user", "alice"), count("hits", "user", "alice")) == (1200, 1024)
    assert count("queries", "user", NO_USER) == 40
    assert len(cache.by_user) == MAX_TRACKED_USERS + 1  # the named callers, then one shared row
    assert count("queries", "user", OTHER_USERS) == 10 * (MAX_TRACKED_USERS + 5 - (MAX_TRACKED_USERS - 2))
    assert (count("queries", "prompt_length", "512-2047"), count("hits", "prompt_length", "512-2047")) == (
        1200,
        1024,
    )
    assert count("queries", "prompt_length", "0-127") == 40 + 10 * (MAX_TRACKED_USERS + 5)


def test_token_buckets_are_1_2_5():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
