"""Prometheus metrics for /metrics, with vLLM's names so its dashboards and autoscalers work.

Every name is `{prefix}:{name}` (prefix `pagedllm`, or `vllm` with --metrics-prefix vllm) with
the label `model_name`. Gauges and engine counters follow the SchedulerStats snapshot taken after
each engine step; per-request histograms are fed from RequestMetrics when a request finishes,
time to first token and inter-token latency as tokens arrive.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.metrics.stats import (
    MAX_CALLER_NAME_CHARS,
    MAX_TRACKED_USERS,
    OTHER_USERS,
    PrefixCacheStats,
    SchedulerStats,
)
from pagedllm.outputs import RequestOutput

# vLLM's buckets, so histograms line up with its dashboards.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]  # fmt: skip
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class PrometheusMetrics:
    """Owns its registry (several servers can live in one process, as in tests).

    `record` runs on the engine thread after every loop turn; prometheus_client is thread-safe,
    so `render` may run on the event loop at any time.
    """

    def __init__(
        self,
        model_name: str,
        *,
        prefix: str = "pagedllm",
        max_model_len: int,
        cache_config: dict[str, str],
        caller_labels: bool = True,
    ) -> None:
        """caller_labels: export the hit breakdown by caller (`user` strings become label values)."""
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def name(metric: str) -> str:
            return f"{prefix}:{metric}"

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(name(metric), doc, ["model_name"], registry=self.registry).labels(**label)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(name(metric), doc, ["model_name"], registry=self.registry).labels(**label)

        def histogram(metric: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(
                name(metric), doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(**label)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for a seat.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held (0-1).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._hit_breakdowns = {  # label -> (queries, hits), fed from PrefixCacheStats' breakdowns
            label: tuple(
                Counter(
                    name(f"prefix_cache_{kind}_by_{label}"),
                    f"Prompt tokens {verb} the prefix cache, by {what}.",
                    ["model_name", label],
                    registry=self.registry,
                )
                for kind, verb in (("queries", "looked up in"), ("hits", "found in"))
            )
            for label, what in (
                ("prompt_length", "prompt-length bucket (tokens)"),
                (
                    "user",
                    f"caller (`user`, its first {MAX_CALLER_NAME_CHARS} characters; "
                    f"{MAX_TRACKED_USERS} by name, later ones as {OTHER_USERS!r})",
                ),
            )
            if label != "user" or caller_labels
        }
        self._last_breakdowns: dict[tuple[str, str], tuple[int, int]] = {}
        self._request_success = Counter(
            name("request_success"),
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Queued to first scheduled.", _REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First to last token.", _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", token_buckets(max_model_len)
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output length of finished requests.", token_buckets(max_model_len)
        )
        Gauge(
            name("cache_config_info"),
            "KV cache configuration, as labels.",
            ["model_name", *cache_config],
            registry=self.registry,
        ).labels(model_name=model_name, **cache_config).set(1)

        self._engine_counters = (
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.generation_tokens,
        )
        self._last_counts = _engine_counts(SchedulerStats())
        self._last_token_times: dict[str, float] = {}
        """Live requests that have their first token: when their latest token came."""

    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        counts = _engine_counts(stats)
        for counter, now, before in zip(self._engine_counters, counts, self._last_counts, strict=True):
            counter.inc(now - before)
        if counts[0] != self._last_counts[0]:  # prompt tokens were looked up: some breakdown moved
            self._record_hit_breakdowns(stats.prefix_cache)
        self._last_counts = counts
        for output in outputs:
            self._record_tokens(output)
            if output.finished:
                self._record_finished(output)

    def _record_hit_breakdowns(self, prefix_cache: PrefixCacheStats) -> None:
        for label, by_value in (
            ("prompt_length", prefix_cache.by_prompt_length),
            ("user", prefix_cache.by_user),
        ):
            if label not in self._hit_breakdowns:
                continue
            queries, hits = self._hit_breakdowns[label]
            for value, counts in by_value.items():
                last_queries, last_hits = self._last_breakdowns.get((label, value), (0, 0))
                if counts.queries == last_queries:
                    continue
                labels = {"model_name": self._model_name, label: value}
                queries.labels(**labels).inc(counts.queries - last_queries)
                hits.labels(**labels).inc(counts.hits - last_hits)
                self._last_breakdowns[(label, value)] = (counts.queries, counts.hits)

    def _record_tokens(self, output: RequestOutput) -> None:
        token_time = output.metrics.last_token_time
        if token_time is None:
            return
        previous = self._last_token_times.get(output.request_id)
        if previous is None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            ttft = output.metrics.time_to_first_token
            if ttft is not None:
                self.ttft.observe(ttft)
        elif token_time > previous:
            self.itl.observe(token_time - previous)
        self._last_token_times[output.request_id] = token_time

    def _record_finished(self, output: RequestOutput) -> None:
        self._last_token_times.pop(output.request_id, None)
        reason = output.outputs[0].finish_reason or "abort"
        self._request_success.labels(model_name=self._model_name, finished_reason=reason).inc()
        metrics = output.metrics
        for histogram, value in (
            (self.e2e, metrics.e2e_latency),
            (self.queue_time, metrics.queue_time),
            (self.prefill_time, metrics.prefill_time),
            (self.decode_time, metrics.decode_time),
        ):
            if value is not None:
                histogram.observe(value)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(len(output.outputs[0].token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _engine_counts(stats: SchedulerStats) -> tuple[int, int, int, int]:
    """The engine's running totals that feed counters, in `_engine_counters` order."""
    return (
        stats.prefix_cache.queries,
        stats.prefix_cache.hits,
        stats.num_preemptions,
        stats.num_generation_tokens,
    )
