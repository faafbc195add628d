"""What `pagedllm bench serve` measures, per request and over a run, with `vllm bench serve`'s names.

A token chunk is a streamed completion chunk (even with empty text: part of a character), a chat
chunk with content, or the chunk that ends a choice; a server may put several tokens in one chunk,
so ITL is the gap between chunks, as vLLM measures it. The peak of output tokens counts per
second of the run, as vLLM's does; the peak of requests (`max_concurrent_requests`) is those in
flight at one instant, so it never passes --max-concurrency (vLLM counts every request active at
any time in a second, which a closed loop of N clients takes past N).

    TTFT = first token chunk - send           ITL  = gap between consecutive token chunks
    TPOT = (E2EL - TTFT) / (output tokens - 1) E2EL = end of stream - send
    goodput = requests/s that meet every --goodput objective (ttft, tpot, e2el in ms)
    prefix hit rate = sum(cached_tokens) / sum(prompt_tokens) over requests whose server reports it
    draft acceptance = sum(accepted drafts) / sum(draft tokens) over requests whose server reports
        them (pagedllm's per-response `timings`, llama.cpp's names: draft_n, draft_n_accepted);
        per request too, because in a closed loop the request that accepts least sets the end
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
QUANTILES = (50, 95, 99)
_ATTRS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}


@dataclass
class RequestRecord:
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str | None = None
    start_s: float = 0.0
    """When it was sent, in seconds after the run began."""
    itl_s: list[float] = field(default_factory=list)
    draft_tokens: int | None = None
    """Speculative decoding: the draft tokens the server checked for it (None: not reported)."""
    accepted_draft_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServeResult:
    records: list[RequestRecord] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_hit_rate(self) -> float | None:
        reported = [r for r in self.ok if r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in reported)
        return sum(r.cached_tokens or 0 for r in reported) / prompt if reported and prompt else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        reported = [r for r in self.ok if r.draft_tokens is not None]
        drafts = sum(r.draft_tokens or 0 for r in reported)
        return sum(r.accepted_draft_tokens or 0 for r in reported) / drafts if drafts else None

    def quantiles(self, name: str) -> dict[str, float] | None:
        """p50/p95/p99/mean of a record attribute in seconds (our JSON's `ttft_s`, `tpot_s`, `e2e_s`)."""
        values = [v for r in self.ok if (v := getattr(r, name)) is not None]
        if not values:
            return None
        return {f"p{q}": float(np.percentile(values, q)) for q in QUANTILES} | {
            "mean": float(np.mean(values))
        }

    def values(self, metric: str) -> list[float]:
        """Seconds of one of METRICS over the completed requests (ITL: every gap of every request)."""
        if metric == "itl":
            return [gap for r in self.ok for gap in r.itl_s]
        return [v for r in self.ok if (v := getattr(r, _ATTRS[metric])) is not None]

    def num_good(self, slos_ms: dict[str, float]) -> int:
        """Completed requests within every objective; TPOT of a one-token answer counts as 0."""
        return sum(
            all((getattr(r, _ATTRS[name]) or 0.0) * 1e3 <= limit for name, limit in slos_ms.items())
            for r in self.ok
        )

    def peaks(self) -> tuple[float, int]:
        """Most token chunks in one second of the run, and most requests in flight at once."""
        return self._peak_tokens_per_s(), self._peak_in_flight()

    def _peak_tokens_per_s(self) -> float:
        if not self.ok:
            return 0.0
        tokens = np.zeros(math.ceil(max(r.start_s + r.e2e_s for r in self.ok)) + 1)
        for r in self.ok:
            chunk_times = r.start_s + (r.ttft_s or 0.0) + np.cumsum([0.0, *r.itl_s])
            np.add.at(tokens, chunk_times.astype(int), 1)
        return float(tokens.max())

    def _peak_in_flight(self) -> int:
        """The count peaks as a request is sent: those sent by then less those ended by then (a
        client's next request, sent as its last one ends, does not overlap it). Failed requests
        count too; they held a seat while they ran."""
        if not self.records:
            return 0
        starts = np.sort([r.start_s for r in self.records])
        ends = np.sort([r.start_s + r.e2e_s for r in self.records])
        in_flight = np.searchsorted(starts, starts, "right") - np.searchsorted(ends, starts, "right")
        return int(in_flight.max())

    def summary(
        self, metrics: list[str], percentiles: list[float], slos_ms: dict[str, float] | None
    ) -> dict[str, float | int | None]:
        """The run under `vllm bench serve`'s JSON keys; latencies in ms, None where nothing was measured."""
        ok = self.ok
        total_input = sum(r.prompt_tokens for r in ok)
        total_output = sum(r.output_tokens for r in ok)
        duration = self.elapsed_s or math.inf
        peak_tokens, peak_in_flight = self.peaks()
        summary: dict[str, float | int | None] = {
            "duration": self.elapsed_s,
            "completed": len(ok),
            "failed": len(self.records) - len(ok),
            "total_input_tokens": total_input,
            "total_output_tokens": total_output,
            "request_throughput": len(ok) / duration,
            "request_goodput": self.num_good(slos_ms) / duration if slos_ms else None,
            "output_throughput": total_output / duration,
            "total_token_throughput": (total_input + total_output) / duration,
            "max_output_tokens_per_s": peak_tokens,
            "max_concurrent_requests": peak_in_flight,
        }
        for metric in metrics:
            values = np.array(self.values(metric)) * 1e3
            stats: dict[str, Callable[[np.ndarray], Any]] = {
                "mean": np.mean,
                "median": np.median,
                "std": np.std,
            }
            for name, stat in stats.items():
                summary[f"{name}_{metric}_ms"] = float(stat(values)) if values.size else None
            for q in percentiles:
                value = float(np.percentile(values, q)) if values.size else None
                summary[f"p{q:g}_{metric}_ms"] = value
        return summary
