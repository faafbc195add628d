"""Counters the engine keeps and the loggers, /metrics and benchmarks read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache accounting, in tokens, counted once per request at first admission.

    `hits / queries` is the hit rate users read. A preempted request that finds its own
    blocks again on resume is not a hit: those tokens go to `preempted_recompute_saved`,
    so the hit rate is never inflated by memory pressure.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_recompute_saved: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    """A snapshot after one step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_used_slots: int = 0
    """Token slots holding K/V of running requests (the rest of their blocks is slack)."""
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    """Total since start."""
    num_prompt_tokens_computed: int = 0
    """Total prompt tokens that went through the model (prefix hits did not; recomputes after
    preemption did)."""
    num_generation_tokens: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
