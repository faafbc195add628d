"""How many draft tokens a server accepted during a run: vLLM's spec_decode counters on /metrics,
read before and after, or (where a server does not export them) the offline engine's own count on
the same requests.

vLLM exports `vllm:spec_decode_num_drafts`, `_num_draft_tokens` and `_num_accepted_tokens`
(counters, `_total` in the text format, one sample per `engine` label); pagedllm exports the same
names under `pagedllm:` (or `vllm:`), and this reads any prefix. For a server without them (a
pagedllm from before issue 24's item 4), `offline_counts` runs the requests through `LLMEngine` in
a subprocess, a closed loop at the same concurrency, and reads `get_stats()`.

    acceptance rate = accepted / draft tokens
    mean acceptance length = 1 + accepted / drafts   (tokens a checking step gives a request)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_SAMPLE = re.compile(
    r"^[A-Za-z_]\w*:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens)(?:_total)?"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class SpecCounts:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(*(getattr(self, c) - getattr(other, c) for c in COUNTERS))

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(*(getattr(self, c) + getattr(other, c) for c in COUNTERS))

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def parse_metrics(text: str) -> SpecCounts | None:
    """The three counters summed over label sets; None where the text has none of them (a server
    without speculation, or one that does not export it)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    found = False
    for name, value in _SAMPLE.findall(text):
        totals[name] += float(value)
        found = True
    return SpecCounts(*(round(totals[c]) for c in COUNTERS)) if found else None


def scrape(url: str) -> SpecCounts | None:
    """The counters of the server at `url` now (its /metrics), None where it exports none."""
    response = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
    response.raise_for_status()
    return parse_metrics(response.text)


def offline_counts(
    workload: Path, num_requests: int, concurrency: int, engine_flags: list[str], out: Path
) -> SpecCounts:
    """The offline engine's counters after the first `num_requests` of `workload`, `concurrency`
    at a time, with `engine_flags` (the server's): a separate process, so its threads and memory
    end with it."""
    cmd = [sys.executable, "-P", __file__, str(workload), str(num_requests), str(concurrency)]
    subprocess.run([*cmd, str(out), *engine_flags], check=True, stdout=subprocess.DEVNULL)
    return SpecCounts(**json.loads(out.read_text()))


def _offline_main() -> None:
    """workload num_requests concurrency out.json ENGINE_FLAGS...: the counters as JSON."""
    from pagedllm.bench.prefix import make_clients, run_closed_loop
    from pagedllm.config import add_engine_args, engine_config_from_args
    from pagedllm.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser()
    for name in ("workload", "num_requests", "concurrency", "out"):
        parser.add_argument(name)
    add_engine_args(parser)
    args = parser.parse_args()
    engine = LLMEngine(engine_config_from_args(args, disable_log_stats=True))
    clients = make_clients(args.workload, engine.tokenizer, int(args.num_requests))
    run_closed_loop(engine, clients, int(args.concurrency))
    stats = engine.get_stats().spec_decode
    if stats is None:
        raise SystemExit("the engine ran without --speculative-config: no counts")
    counts = SpecCounts(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    Path(args.out).write_text(json.dumps(asdict(counts)))


if __name__ == "__main__":
    _offline_main()
