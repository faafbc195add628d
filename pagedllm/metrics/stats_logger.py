"""The periodic stats line, logged every `interval` seconds while the engine is busy:

Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 190.2 tokens/s,
Running: 32 reqs, Waiting: 5 reqs, KV cache usage: 41.3%, Prefix cache hit rate: 88.1%

and with speculative decoding, where drafts were checked in the interval (vLLM's line):

SpecDecoding metrics: Mean acceptance length: 2.41, Accepted: 310 tokens, Drafted: 610 tokens,
Per-position acceptance rate: 0.71, 0.52, 0.40, 0.31, Avg Draft acceptance rate: 50.8%
"""

from __future__ import annotations

import logging
import time

from pagedllm.metrics.stats import SchedulerStats, SpecDecodeStats

logger = logging.getLogger(__name__)


class StatsLogger:
    def __init__(self, interval: float, prefix_caching: bool) -> None:
        self.interval = interval
        self.prefix_caching = prefix_caching
        self._last_time = time.monotonic()
        self._last_prompt_tokens = 0
        self._last_generation_tokens = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_spec = SpecDecodeStats()

    def is_due(self) -> bool:
        return time.monotonic() - self._last_time >= self.interval

    def log(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        prompt = stats.num_prompt_tokens_computed - self._last_prompt_tokens
        generation = stats.num_generation_tokens - self._last_generation_tokens
        busy = prompt or generation or stats.num_running_reqs or stats.num_waiting_reqs
        if busy:
            line = (
                f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
                f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%"
            )
            if self.prefix_caching:
                queries = stats.prefix_cache.queries - self._last_queries
                hits = stats.prefix_cache.hits - self._last_hits
                line += f", Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
            logger.info(line)
        if stats.spec_decode is not None:
            self._log_spec_decode(stats.spec_decode)
        self._last_time = now
        self._last_prompt_tokens = stats.num_prompt_tokens_computed
        self._last_generation_tokens = stats.num_generation_tokens
        self._last_queries = stats.prefix_cache.queries
        self._last_hits = stats.prefix_cache.hits

    def _log_spec_decode(self, spec: SpecDecodeStats) -> None:
        last = self._last_spec
        drafts, drafted = spec.num_drafts - last.num_drafts, spec.num_draft_tokens - last.num_draft_tokens
        if drafted:
            accepted = spec.num_accepted_tokens - last.num_accepted_tokens
            per_pos = [
                (count - (last.accepted_per_pos[pos] if pos < len(last.accepted_per_pos) else 0)) / drafts
                for pos, count in enumerate(spec.accepted_per_pos)
            ]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                1 + accepted / drafts,
                accepted,
                drafted,
                ", ".join(f"{rate:.2f}" for rate in per_pos),
                100 * accepted / drafted,
            )
        self._last_spec = SpecDecodeStats(
            spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_pos)
        )
