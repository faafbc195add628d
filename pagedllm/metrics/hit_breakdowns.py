"""Prefix-cache hits by prompt length, by caller and by LoRA adapter on /metrics: pagedllm's own
families (vLLM has no such breakdown), `{prefix}:prefix_cache_{queries,hits}_by_{prompt_length,user,
adapter}`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from pagedllm.metrics.stats import (
    BASE_MODEL,
    MAX_CALLER_NAME_CHARS,
    MAX_TRACKED_USERS,
    OTHER_USERS,
    PrefixCacheStats,
)

_BREAKDOWNS = {
    "prompt_length": "prompt-length bucket (tokens)",
    "user": f"caller (`user`, its first {MAX_CALLER_NAME_CHARS} characters; {MAX_TRACKED_USERS} by name, "
    f"later ones as {OTHER_USERS!r})",
    "adapter": f"LoRA adapter ({BASE_MODEL!r} for requests that name none)",
}


class HitBreakdowns:
    """Counters that follow PrefixCacheStats' running totals by prompt length and by caller."""

    def __init__(
        self, registry: CollectorRegistry, prefix: str, labels: dict[str, str], caller_labels: bool
    ) -> None:
        """caller_labels: export the breakdown by caller (`user` strings become label values)."""
        self._labels = labels
        self._counters = {  # label -> (queries, hits)
            label: tuple(
                Counter(
                    f"{prefix}:prefix_cache_{kind}_by_{label}",
                    f"Prompt tokens {verb} the prefix cache, by {what}.",
                    [*labels, label],
                    registry=registry,
                )
                for kind, verb in (("queries", "looked up in"), ("hits", "found in"))
            )
            for label, what in _BREAKDOWNS.items()
            if label != "user" or caller_labels
        }
        self._last: dict[tuple[str, str], tuple[int, int]] = {}

    def record(self, prefix_cache: PrefixCacheStats) -> None:
        """Add what moved since the last call (PrefixCacheStats holds totals)."""
        for label, by_value in (
            ("prompt_length", prefix_cache.by_prompt_length),
            ("user", prefix_cache.by_user),
            ("adapter", prefix_cache.by_adapter),
        ):
            if label not in self._counters:
                continue
            queries, hits = self._counters[label]
            for value, counts in by_value.items():
                last_queries, last_hits = self._last.get((label, value), (0, 0))
                if counts.queries == last_queries:
                    continue
                labels = {**self._labels, label: value}
                queries.labels(**labels).inc(counts.queries - last_queries)
                hits.labels(**labels).inc(counts.hits - last_hits)
                self._last[(label, value)] = (counts.queries, counts.hits)
