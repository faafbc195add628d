"""Counters the engine keeps and the loggers, /metrics and benchmarks read."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

# Prompt-length buckets for the hit rate: where do hits happen (and where don't they)?
PROMPT_LENGTH_BUCKETS = (128, 512, 2048, 8192)

MAX_TRACKED_USERS = 100
"""Callers counted by name; callers first seen after that many share the OTHER_USERS row, so a
long-running server's memory and its /metrics label set stay bounded."""
MAX_CALLER_NAME_CHARS = 64
"""A caller is counted under the first this many characters of its name (a bounded label)."""
NO_USER = "(none)"
BASE_MODEL = "(base model)"
"""The adapter row of requests that name none."""
OTHER_USERS = "(other)"


def prompt_length_bucket(num_tokens: int) -> str:
    low = 0
    for high in PROMPT_LENGTH_BUCKETS:
        if num_tokens < high:
            return f"{low}-{high - 1}"
        low = high
    return f"{low}+"


@dataclass
class HitCounts:
    """Requests, prompt tokens looked up (queries) and found (hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def add(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens

    def merge(self, other: HitCounts) -> None:
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits

    def to_dict(self) -> dict:
        """As /stats shows it (the rate included)."""
        return {
            "requests": self.requests,
            "queries": self.queries,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
        }

    @classmethod
    def from_dict(cls, data: dict) -> HitCounts:
        return cls(data["requests"], data["queries"], data["hits"])


@dataclass
class PrefixCacheStats(HitCounts):
    """Prefix-cache accounting, in tokens, counted once per request at first admission,
    overall, by caller (the request's `user`, at most MAX_TRACKED_USERS names), by LoRA
    adapter (BASE_MODEL for none) and by prompt-length bucket; /metrics exports them all.

    `hits / queries` is the hit rate users read. A preempted request that finds its own
    blocks again on resume is not a hit: those tokens go to `preempted_recompute_saved`,
    so the hit rate is never inflated by memory pressure.
    """

    preempted_recompute_saved: int = 0
    by_user: dict[str, HitCounts] = field(default_factory=dict)
    by_prompt_length: dict[str, HitCounts] = field(default_factory=dict)
    by_adapter: dict[str, HitCounts] = field(default_factory=dict)

    def record(
        self, user: str | None, num_prompt_tokens: int, num_hit_tokens: int, adapter: str | None = None
    ) -> None:
        """`adapter`: the LoRA adapter's name (None: the base model)."""
        self.add(num_prompt_tokens, num_hit_tokens)
        for groups, name in ((self.by_user, user or NO_USER), (self.by_adapter, adapter or BASE_MODEL)):
            name = name[:MAX_CALLER_NAME_CHARS]
            if name not in groups and len(groups) >= MAX_TRACKED_USERS:
                name = OTHER_USERS
            groups.setdefault(name, HitCounts()).add(num_prompt_tokens, num_hit_tokens)
        bucket = prompt_length_bucket(num_prompt_tokens)
        self.by_prompt_length.setdefault(bucket, HitCounts()).add(num_prompt_tokens, num_hit_tokens)

    def snapshot(self, top_users: int) -> dict:
        """As /stats shows it: the counts, by prompt length, and the `top_users` callers that
        looked up the most prompt tokens."""
        callers = sorted(self.by_user.items(), key=lambda item: -item[1].queries)[:top_users]
        return {
            **self.to_dict(),
            "preempted_recompute_saved": self.preempted_recompute_saved,
            "by_prompt_length": {b: c.to_dict() for b, c in sorted(self.by_prompt_length.items())},
            "by_user": {user: c.to_dict() for user, c in callers},
            "by_adapter": {name: c.to_dict() for name, c in sorted(self.by_adapter.items())},
        }

    @classmethod
    def sum_of_snapshots(cls, snapshots: Iterable[dict]) -> PrefixCacheStats:
        """Several snapshots (replicas') added up: groups of the same name summed."""
        total = cls()
        for snapshot in snapshots:
            total.merge(HitCounts.from_dict(snapshot))
            total.preempted_recompute_saved += snapshot["preempted_recompute_saved"]
            for groups, name in (
                (total.by_user, "by_user"),
                (total.by_prompt_length, "by_prompt_length"),
                (total.by_adapter, "by_adapter"),
            ):
                for key, counts in snapshot.get(name, {}).items():
                    groups.setdefault(key, HitCounts()).merge(HitCounts.from_dict(counts))
        return total


@dataclass
class SpecDecodeStats:
    """Speculative decoding since start, as vLLM's spec_decode_* counters: steps of a request
    that checked drafts, draft tokens checked, accepted, and accepted by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a checking step gives a request: the accepted drafts and the one after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @classmethod
    def sum_of_snapshots(cls, snapshots: list[dict]) -> dict | None:
        """Replicas' /stats views as one (the router's); None when none speculates."""
        if not snapshots:
            return None
        total = cls()
        for snap in snapshots:
            total.num_drafts += snap["num_drafts"]
            total.num_draft_tokens += snap["num_draft_tokens"]
            total.num_accepted_tokens += snap["num_accepted_tokens"]
            per_pos = snap["accepted_per_pos"]
            total.accepted_per_pos += [0] * (len(per_pos) - len(total.accepted_per_pos))
            for pos, count in enumerate(per_pos):
                total.accepted_per_pos[pos] += count
        return total.snapshot()

    def snapshot(self) -> dict:
        """/stats' view."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


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
    num_disk_hit_tokens: int = 0
    """Of the prefix-cache hit tokens, those the disk tier (--kv-offload-dir) supplied."""
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decode: SpecDecodeStats | None = None
    """None without --speculative-config."""
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    """With --enable-lora: running requests by adapter name (vLLM's lora_requests_info labels)."""
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


class EngineTotals(NamedTuple):
    """The engine's running totals that rates and counters follow: SchedulerStats holds totals,
    so a reader takes one snapshot per interval and subtracts the one before (`since`)."""

    queries: int = 0
    hits: int = 0
    preemptions: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    disk_hits: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def of(cls, stats: SchedulerStats) -> EngineTotals:
        cache, spec = stats.prefix_cache, stats.spec_decode or SpecDecodeStats()
        return cls(
            cache.queries,
            cache.hits,
            stats.num_preemptions,
            stats.num_prompt_tokens_computed,
            stats.num_generation_tokens,
            stats.num_disk_hit_tokens,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
        )

    def since(self, before: EngineTotals) -> EngineTotals:
        return EngineTotals(*(now - then for now, then in zip(self, before, strict=True)))
