"""Which replica gets a request: round robin, least loaded, or cache aware (SGLang's cache_aware
policy, Ray Serve's prefix-cache affinity router).

Cache aware, in order:
1. The replica that has seen the longest prefix of the prompt, if that is at least `cache_threshold`
   of it (or `min_match_chars`) and its load has not diverged from the idlest one's (more than
   `balance_abs_threshold` requests in flight above it and more than `balance_rel_threshold` times
   as many), so that a popular prefix cannot pile every request onto one replica.
2. Otherwise the least loaded, ties to the smallest index (the most room for a new prefix).
The chosen replica's index then records the prompt, so its followers come to the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagedllm.entrypoints.router.prefix_index import PrefixIndex, chunk_hashes

POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass
class Replica:
    """One pagedllm server behind the router, as the router sees it."""

    url: str
    index: PrefixIndex
    is_healthy: bool = True
    num_in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0


class Policy(Protocol):
    def select(self, text: str, candidates: list[Replica]) -> Replica:
        """Pick one of `candidates` (non-empty, all healthy) for a prompt `text`."""
        ...


class RoundRobin:
    """Each request to the next replica: the baseline that spreads every prefix everywhere."""

    def __init__(self) -> None:
        self._num_selected = 0

    def select(self, text: str, candidates: list[Replica]) -> Replica:
        replica = candidates[self._num_selected % len(candidates)]
        self._num_selected += 1
        return replica


class LeastLoaded:
    """The replica with the fewest requests in flight (the first one on ties)."""

    def select(self, text: str, candidates: list[Replica]) -> Replica:
        return min(candidates, key=lambda r: r.num_in_flight)


@dataclass
class CacheAware:
    """Prefix affinity with a load-balance escape hatch; the module docstring has the rules."""

    cache_threshold: float = 0.5
    min_match_chars: int = 2048
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"the cache threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"the balance thresholds must be >= 0 (absolute, got {self.balance_abs_threshold}) and "
                f">= 1 (relative, got {self.balance_rel_threshold}); see --balance-threshold and "
                "--balance-rel-threshold"
            )

    def select(self, text: str, candidates: list[Replica]) -> Replica:
        idlest = min(candidates, key=lambda r: (r.num_in_flight, len(r.index)))
        hashes = chunk_hashes(text, idlest.index.chunk_chars)
        best, num_matched = max(
            ((r, r.index.match_chars(hashes)) for r in candidates), key=lambda pair: pair[1]
        )
        is_long_enough = num_matched > 0 and (
            num_matched >= self.cache_threshold * len(text) or num_matched >= self.min_match_chars
        )
        chosen = best if is_long_enough and not self._has_diverged(best, idlest) else idlest
        chosen.index.insert(hashes)
        return chosen

    def _has_diverged(self, replica: Replica, idlest: Replica) -> bool:
        busy, idle = replica.num_in_flight, idlest.num_in_flight
        return busy - idle > self.balance_abs_threshold and busy > idle * self.balance_rel_threshold


def make_policy(name: str, cache_aware: CacheAware) -> Policy:
    """The policy called `name`; `cache_aware` carries that policy's knobs."""
    if name == "cache_aware":
        return cache_aware
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
