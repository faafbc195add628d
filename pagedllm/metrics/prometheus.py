"""Prometheus metrics for /metrics: vLLM's families (names, types, labels, buckets), so dashboards,
alerts and autoscalers built for vLLM work unchanged.

Every engine family is `{prefix}:{name}` (prefix `pagedllm`, or `vllm` with --metrics-prefix vllm)
labelled `model_name`; under `vllm` also `engine="0"`, as vLLM labels each of its data-parallel
engines (there is one here). Where the figures come from:

    SchedulerStats after each step   gauges; prefix-cache, preemption and generation counters;
                                     tokens per step (iteration_tokens_total)
    RequestOutput as tokens arrive   prompt tokens, time to first token, inter-token latency
    RequestOutput when finished      request_success and the per-request histograms
    the HTTP routes                  n and max_tokens of admitted requests, queue-full refusals

/metrics is open, as vLLM's is (scrapers need no key); so a server whose API needs a key leaves
out the breakdown by caller, whose labels are the callers' `user` strings, unless the operator
asks for it (caller_labels_on).

The registry also holds prometheus_client's process_* and python_* collectors; metrics/http.py
adds http_*. vLLM families with no meaning here (KV connectors, multi-modal caches, sleep mode)
are left out rather than exported as zeros, as are those of what is off (speculative decoding,
LoRA: `lora_requests_info` exists with --enable-lora, as in vLLM);
tests/metrics/test_metrics_parity.py lists them with reasons.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagedllm.metrics import buckets
from pagedllm.metrics.hit_breakdowns import HitBreakdowns
from pagedllm.metrics.stats import EngineTotals, SchedulerStats, SpecDecodeStats
from pagedllm.outputs import RequestOutput

FINISH_REASONS = ("stop", "length", "abort", "error")
_SPANS = {  # span of a finished request -> (family, what it measures), vLLM's definitions
    "e2e_latency": ("e2e_request_latency_seconds", "Arrival to finish."),
    "queue_time": ("request_queue_time_seconds", "Queued to first scheduled."),
    "inference_time": ("request_inference_time_seconds", "First scheduled to last token."),
    "prefill_time": ("request_prefill_time_seconds", "First scheduled to first token."),
    "decode_time": ("request_decode_time_seconds", "First to last token."),
}


MAX_EXPORTED_DRAFT_POSITIONS = 16
"""Draft positions with their own accepted-tokens series on /metrics (vLLM exports one per
position up to num_speculative_tokens, which is rarely more)."""


def caller_labels_on(flag: bool | None, api_key: str | None) -> bool:
    """--metrics-caller-label as given; left out, on only when the API needs no key (with a key,
    /stats is guarded for naming callers, and open /metrics must not name them either)."""
    return flag if flag is not None else api_key is None


class PrometheusMetrics:
    """Owns its registry (several servers can live in one process, as in tests).

    `record` runs on the engine thread after every loop turn (at most one step each);
    prometheus_client is thread-safe, so `render` and the HTTP routes' `record_*` calls may run
    on the event loop at any time.
    """

    def __init__(
        self,
        model_name: str,
        *,
        prefix: str = "pagedllm",
        max_model_len: int,
        cache_config: dict[str, str],
        caller_labels: bool = True,
        num_speculative_tokens: int | None = None,
        max_loras: int | None = None,
    ) -> None:
        """caller_labels: export the hit breakdown by caller (`user` strings become label values).
        num_speculative_tokens: speculative decoding is on, with drafts up to this long (its
        families, vLLM's spec_decode_*, exist only then, as in vLLM). max_loras: LoRA is on
        (--max-loras; vLLM's lora_requests_info exists only then)."""
        self.registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)  # stateless readers of this process: safe to share
        self._prefix = prefix
        self._labels = {"model_name": model_name} | ({"engine": "0"} if prefix == "vllm" else {})
        self._add_step_families()
        self._add_request_families(buckets.token_buckets(max_model_len))
        self.admission_rejections = Counter(
            f"{prefix}:admission_rejections",
            "Requests refused by a queue limit (--max-queue-len), by reason.",
            ["model_name", "reason"],  # vLLM counts these in its API server: no engine label
            registry=self.registry,
        ).labels(model_name=model_name, reason="max_num_queued_reqs")
        Gauge(
            f"{prefix}:cache_config_info",
            "KV cache configuration, as labels.",
            [*self._labels, *cache_config],
            registry=self.registry,
        ).labels(**self._labels, **cache_config).set(1)
        self._hit_breakdowns = HitBreakdowns(self.registry, prefix, self._labels, caller_labels)
        self._spec_decode = (
            None if num_speculative_tokens is None else self._add_spec_decode_families(num_speculative_tokens)
        )
        self._last_spec_decode: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self._lora_info = (
            None
            if max_loras is None
            else Gauge(  # vLLM's: no model_name label; the labels say which adapters, the value when
                f"{prefix}:lora_requests_info",
                "Running stats on LoRA requests: the adapters running and waiting, as labels; the value "
                "is when they were last seen.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
        )
        self._max_loras = str(max_loras)
        self._last_lora_labels: tuple[str, str, str] | None = None
        self._last_counts = EngineTotals()
        self._last_token_times: dict[str, float] = {}
        """Live requests that have their first token: when their latest token came."""

    def _add_step_families(self) -> None:
        """What follows SchedulerStats."""
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting for a seat.")
        # vLLM's other reason, "deferred" (LoRA budget, KV transfer), cannot happen here.
        self.num_requests_waiting_for_capacity = self._gauge(
            "num_requests_waiting_by_reason", "Waiting requests, by reason.", reason="capacity"
        )
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held (0-1).")
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens_cached_by_source = self._counters(
            "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens, by the tier that held them: device memory, or the disk tier "
            "(--kv-offload-dir) that a lookup brought them back from.",
            "source",
            ("device", "disk"),
        )
        self.num_preemptions = self._counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total",
            "Tokens per engine step (prompt and generated).",
            buckets.ITERATION_TOKENS,
        )

    def _add_spec_decode_families(
        self, num_positions: int
    ) -> tuple[Counter, Counter, Counter, dict[str, Counter]]:
        """vLLM's names: steps of a request that checked drafts, draft tokens, accepted ones,
        and accepted ones by position in the draft (the first MAX_EXPORTED_DRAFT_POSITIONS: a
        series per position of a 1,024-token draft would bloat every scrape, and acceptance far
        down a draft is what the totals already say)."""
        return (
            self._counter("spec_decode_num_drafts", "Steps of a request that checked draft tokens."),
            self._counter("spec_decode_num_draft_tokens", "Draft tokens checked."),
            self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            self._counters(
                "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in their draft.",
                "position",
                tuple(str(pos) for pos in range(min(num_positions, MAX_EXPORTED_DRAFT_POSITIONS))),
            ),
        )

    def _record_spec_decode(self, stats: SpecDecodeStats) -> None:
        assert self._spec_decode is not None
        drafts, draft_tokens, accepted, per_pos = self._spec_decode
        last_drafts, last_tokens, last_accepted, last_per_pos = self._last_spec_decode
        drafts.inc(stats.num_drafts - last_drafts)
        draft_tokens.inc(stats.num_draft_tokens - last_tokens)
        accepted.inc(stats.num_accepted_tokens - last_accepted)
        for pos, count in enumerate(stats.accepted_per_pos):
            if str(pos) in per_pos:
                per_pos[str(pos)].inc(count - (last_per_pos[pos] if pos < len(last_per_pos) else 0))
        self._last_spec_decode = (
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.accepted_per_pos),
        )

    def _add_request_families(self, token_buckets: list[float]) -> None:
        """What follows each request's outputs, and the HTTP routes."""
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Prompt tokens of requests that started generating."
        )
        self.prompt_tokens_cached = self._counter(
            "prompt_tokens_cached", "Prompt tokens of requests that started generating, served by the cache."
        )
        self.prompt_tokens_by_source = self._counters(
            "prompt_tokens_by_source",
            "Prompt tokens, by where their K/V came from.",
            "source",
            ("local_compute", "local_cache_hit"),  # no external KV transfer here
        )
        self.request_success = self._counters(
            "request_success", "Finished requests, by finish reason.", "finished_reason", FINISH_REASONS
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Arrival to first token.", buckets.TIME_TO_FIRST_TOKEN
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between two tokens.", buckets.INTER_TOKEN_LATENCY
        )
        self.time_per_output_token = self._histogram(
            "request_time_per_output_token_seconds",
            "Decode time over the output tokens after the first, per request.",
            buckets.INTER_TOKEN_LATENCY,
        )
        self.spans = {
            span: self._histogram(metric, doc, buckets.REQUEST_LATENCY)
            for span, (metric, doc) in _SPANS.items()
        }
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        )
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Output length of finished requests.", token_buckets
        )
        self.request_prefill_kv_computed_tokens = self._histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens of finished requests that were computed, not served by the prefix cache.",
            token_buckets,
        )
        self.request_num_preemptions = self._histogram(
            "request_num_preemptions", "Times a finished request was preempted.", buckets.NUM_PREEMPTIONS
        )
        self.request_params_n = self._histogram(
            "request_params_n", "The n parameter of admitted requests, per prompt.", buckets.REQUEST_PARAMS_N
        )
        self.request_params_max_tokens = self._histogram(
            "request_params_max_tokens",
            "The max_tokens parameter of admitted sequences, where the request sets one.",
            token_buckets,
        )

    def _gauge(self, metric: str, doc: str, **extra: str) -> Gauge:
        family = Gauge(f"{self._prefix}:{metric}", doc, [*self._labels, *extra], registry=self.registry)
        return family.labels(**self._labels, **extra)

    def _counter(self, metric: str, doc: str, **extra: str) -> Counter:
        family = Counter(f"{self._prefix}:{metric}", doc, [*self._labels, *extra], registry=self.registry)
        return family.labels(**self._labels, **extra)

    def _counters(self, metric: str, doc: str, label: str, values: tuple[str, ...]) -> dict[str, Counter]:
        """One family, a series for each value of its extra label."""
        family = Counter(f"{self._prefix}:{metric}", doc, [*self._labels, label], registry=self.registry)
        return {value: family.labels(**self._labels, **{label: value}) for value in values}

    def _histogram(self, metric: str, doc: str, bounds: list[float]) -> Histogram:
        family = Histogram(
            f"{self._prefix}:{metric}", doc, [*self._labels], buckets=bounds, registry=self.registry
        )
        return family.labels(**self._labels)

    # ---- the engine thread -------------------------------------------------------------------

    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.num_requests_waiting_for_capacity.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        counts = EngineTotals.of(stats)
        new = counts.since(self._last_counts)
        self._last_counts = counts
        self.prefix_cache_queries.inc(new.queries)
        self.prefix_cache_hits.inc(new.hits)
        self.prompt_tokens_cached_by_source["disk"].inc(new.disk_hits)
        self.prompt_tokens_cached_by_source["device"].inc(new.hits - new.disk_hits)
        self.num_preemptions.inc(new.preemptions)
        self.generation_tokens.inc(new.generation_tokens)
        if new.prompt_tokens_computed + new.generation_tokens:  # a step ran (one per loop turn)
            self.iteration_tokens.observe(new.prompt_tokens_computed + new.generation_tokens)
        if new.queries:  # prompt tokens were looked up: some breakdown moved
            self._hit_breakdowns.record(stats.prefix_cache)
        if stats.spec_decode is not None and self._spec_decode is not None:
            self._record_spec_decode(stats.spec_decode)
        if self._lora_info is not None:
            self._record_lora(stats)
        for output in outputs:
            self._record_tokens(output)
            if output.finished:
                self._record_finished(output)

    def _record_lora(self, stats: SchedulerStats) -> None:
        """One series, the adapters of the latest step as its labels (vLLM starts a series per
        combination and keeps them all; the one before is removed here, so the count stays one)."""
        assert self._lora_info is not None
        labels = (
            self._max_loras,
            ",".join(sorted(stats.waiting_lora_adapters)),
            ",".join(sorted(stats.running_lora_adapters)),
        )
        if self._last_lora_labels not in (None, labels):
            self._lora_info.remove(*self._last_lora_labels)
        self._lora_info.labels(*labels).set_to_current_time()
        self._last_lora_labels = labels

    def _record_tokens(self, output: RequestOutput) -> None:
        token_time = output.metrics.last_token_time
        if token_time is None:
            return
        previous = self._last_token_times.get(output.request_id)
        if previous is None:  # the first token: the prompt is done, counted once here
            num_prompt_tokens, num_cached = len(output.prompt_token_ids), output.num_cached_tokens
            self.prompt_tokens.inc(num_prompt_tokens)
            self.prompt_tokens_cached.inc(num_cached)
            self.prompt_tokens_by_source["local_compute"].inc(num_prompt_tokens - num_cached)
            self.prompt_tokens_by_source["local_cache_hit"].inc(num_cached)
            ttft = output.metrics.time_to_first_token
            if ttft is not None:
                self.ttft.observe(ttft)
        elif token_time > previous:
            self.itl.observe(token_time - previous)
        self._last_token_times[output.request_id] = token_time

    def _record_finished(self, output: RequestOutput) -> None:
        self._last_token_times.pop(output.request_id, None)
        self.request_success[output.outputs[0].finish_reason or "abort"].inc()
        metrics = output.metrics
        spans = {
            "e2e_latency": metrics.e2e_latency,
            "queue_time": metrics.queue_time,
            "inference_time": _span(metrics.first_scheduled_time, metrics.last_token_time),
            "prefill_time": metrics.prefill_time,
            "decode_time": metrics.decode_time,
        }
        for span, value in spans.items():
            if value is not None:  # a request aborted before that point has no such span
                self.spans[span].observe(value)
        num_prompt_tokens, num_output_tokens = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
        if metrics.decode_time is not None and num_output_tokens > 1:
            # vLLM observes 0 for one-token requests; left out here: they have no decode step.
            self.time_per_output_token.observe(metrics.decode_time / (num_output_tokens - 1))
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        self.request_prefill_kv_computed_tokens.observe(num_prompt_tokens - output.num_cached_tokens)
        self.request_num_preemptions.observe(output.num_preemptions)

    # ---- the HTTP routes ---------------------------------------------------------------------

    def record_request_params(self, n: int, max_tokens: int | None, num_prompts: int = 1) -> None:
        """An admitted request: n once per prompt and max_tokens once per sequence, as vLLM counts."""
        for _ in range(num_prompts):
            self.request_params_n.observe(n)
        if max_tokens is not None:
            for _ in range(num_prompts * n):
                self.request_params_max_tokens.observe(max_tokens)

    def record_rejection(self) -> None:
        """A request refused because --max-queue-len requests were already waiting."""
        self.admission_rejections.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
