"""PrometheusMetrics on its own: vLLM's names under either prefix (and its `engine` label under
`vllm`), counters from the engine's running totals, histograms from a request's timestamps."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.metrics.buckets import token_buckets
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import MAX_TRACKED_USERS, NO_USER, OTHER_USERS, PrefixCacheStats, SchedulerStats
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _samples(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def _output(
    metrics: RequestMetrics, num_tokens: int, finish_reason: str | None, num_cached_tokens: int = 0
) -> RequestOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), finish_reason=finish_reason)
    return RequestOutput(
        "r", "p", [1, 2, 3], [completion], finish_reason is not None, metrics, num_cached_tokens
    )


def _vllm(name: str, **extra: str) -> tuple[str, tuple]:
    """The key of a vllm: sample labelled like vLLM's (model "m", engine "0")."""
    return f"vllm:{name}", tuple(sorted({"model_name": "m", "engine": "0", **extra}.items()))


def test_vllm_prefix_names_labels_and_values():
    metrics = PrometheusMetrics(
        "m", prefix="vllm", max_model_len=100, cache_config={"block_size": "16", "num_gpu_blocks": "9"}
    )
    times = RequestMetrics(arrival_time=10.0, queued_time=10.0, first_scheduled_time=10.5)
    times.first_token_time = times.last_token_time = 11.0
    cache = PrefixCacheStats(requests=1, queries=3, hits=2)
    # step 1: the prompt's one uncached token, and the first token
    first = SchedulerStats(
        num_running_reqs=1,
        kv_cache_usage=0.25,
        num_prompt_tokens_computed=1,
        num_generation_tokens=1,
        prefix_cache=cache,
    )
    metrics.record(first, [_output(times, 1, None, num_cached_tokens=2)])
    times.last_token_time = times.finished_time = 11.2
    finished = SchedulerStats(num_prompt_tokens_computed=1, num_generation_tokens=2, prefix_cache=cache)
    metrics.record(finished, [_output(times, 2, "length", num_cached_tokens=2)])  # step 2: one token
    metrics.record(finished, [])  # a loop turn without a step
    metrics.record_request_params(n=2, max_tokens=5)
    metrics.record_rejection()
    samples = _samples(metrics)

    assert all(name.startswith(("vllm:", "process_", "python_")) for name, _ in samples)
    assert any(name.startswith("process_") for name, _ in samples)  # on the registry /metrics renders
    assert samples[_vllm("num_requests_running")] == 0
    assert samples[_vllm("num_requests_waiting_by_reason", reason="capacity")] == 0
    assert samples[_vllm("generation_tokens_total")] == 2
    assert samples[_vllm("prompt_tokens_total")] == 3  # counted once, at the first token
    assert samples[_vllm("prompt_tokens_cached_total")] == 2
    assert samples[_vllm("prompt_tokens_by_source_total", source="local_compute")] == 1
    assert samples[_vllm("prompt_tokens_by_source_total", source="local_cache_hit")] == 2
    assert samples[_vllm("prompt_tokens_cached_by_source_total", source="device")] == 2
    assert samples[_vllm("prefix_cache_queries_total")] == 3
    assert samples[_vllm("request_success_total", finished_reason="length")] == 1
    assert samples[_vllm("request_success_total", finished_reason="abort")] == 0
    assert samples[_vllm("iteration_tokens_total_count")] == 2  # two steps: 1 + 1 tokens, then 1
    assert samples[_vllm("iteration_tokens_total_sum")] == 3
    for name, seconds in (
        ("time_to_first_token_seconds", 1.0),
        ("inter_token_latency_seconds", 0.2),
        ("e2e_request_latency_seconds", 1.2),
        ("request_queue_time_seconds", 0.5),
        ("request_prefill_time_seconds", 0.5),
        ("request_inference_time_seconds", 0.7),
        ("request_decode_time_seconds", 0.2),
        ("request_time_per_output_token_seconds", 0.2),
    ):
        assert samples[_vllm(f"{name}_sum")] == pytest.approx(seconds), name
    assert samples[_vllm("request_generation_tokens_sum")] == 2
    assert samples[_vllm("request_prefill_kv_computed_tokens_sum")] == 1
    assert (samples[_vllm("request_params_n_count")], samples[_vllm("request_params_n_sum")]) == (1, 2)
    assert samples[_vllm("request_params_max_tokens_count")] == 2  # once per sequence
    rejected = ("vllm:admission_rejections_total", (("model_name", "m"), ("reason", "max_num_queued_reqs")))
    assert samples[rejected] == 1  # vLLM's API-server counter: no engine label
    info = (("block_size", "16"), ("engine", "0"), ("model_name", "m"), ("num_gpu_blocks", "9"))
    assert samples[("vllm:cache_config_info", info)] == 1


def test_one_token_request_has_no_time_per_output_token():
    metrics = PrometheusMetrics("m", max_model_len=100, cache_config={})
    times = RequestMetrics(arrival_time=1.0, queued_time=1.0, first_scheduled_time=1.0)
    times.first_token_time = times.last_token_time = times.finished_time = 2.0
    metrics.record(SchedulerStats(num_generation_tokens=1), [_output(times, 1, "length")])
    samples = _samples(metrics)
    label = (("model_name", "m"),)  # the default prefix: no engine label
    assert samples[("pagedllm:request_time_per_output_token_seconds_count", label)] == 0
    assert samples[("pagedllm:request_decode_time_seconds_count", label)] == 1


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
