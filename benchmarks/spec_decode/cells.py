"""One measurement cell (engine x workload x concurrency) and its runs: each run one `pagedllm
bench serve` invocation against one server, with the CPU time the rest of the host took meanwhile.

Throughput of a setting = its output tokens summed over the cell's runs / their seconds summed, so
a slow run weighs as much as its length; each off/on pair's own ratio is kept to show the spread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from acceptance import SpecCounts

REPO = Path(__file__).resolve().parents[2]
PAGEDLLM = str(REPO / ".venv/bin/pagedllm")
MODEL_NAME = "SmolLM2-135M-Instruct"
BUSY_SHARE = 0.05
"""CPU share other processes may take during a run before it is flagged as not quiet."""


@dataclass(frozen=True)
class CellRun:
    output_tokens: int
    elapsed_s: float
    num_failed: int
    tpot_p50_s: float | None
    other_cpu_share: float
    """CPU time of processes other than this server and the client, over the run's CPU time."""
    counts: SpecCounts | None = None
    counts_source: str | None = None
    least_acceptance: float | None = None
    """The lowest acceptance rate of a request in the run (from each response's draft counts; None
    where the server reports none): in a closed loop of a few requests that one sets the end."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def with_counts(self, counts: SpecCounts, source: str) -> CellRun:
        return dataclasses.replace(self, counts=counts, counts_source=source)


@dataclass
class Cell:
    engine: str
    workload: str
    concurrency: int
    num_requests: int
    runs: dict[str, list[CellRun]] = field(default_factory=dict)
    """Mode ("off" or a method) -> its runs in order."""
    offline_counts: dict[str, SpecCounts] = field(default_factory=dict)

    def tokens_per_s(self, mode: str) -> float | None:
        runs = self.runs.get(mode)
        if not runs:
            return None
        return sum(r.output_tokens for r in runs) / sum(r.elapsed_s for r in runs)

    def ratio(self, mode: str) -> float | None:
        on, off = self.tokens_per_s(mode), self.tokens_per_s("off")
        return on / off if on is not None and off else None

    def pair_ratios(self, mode: str) -> list[float]:
        pairs = zip(self.runs.get("off", []), self.runs.get(mode, []), strict=False)
        return [on.output_tokens_per_s / off.output_tokens_per_s for off, on in pairs if off.elapsed_s]

    def least_acceptance(self, mode: str) -> float | None:
        rates = [r.least_acceptance for r in self.runs.get(mode, []) if r.least_acceptance is not None]
        return min(rates) if rates else None

    def counts(self, mode: str) -> tuple[SpecCounts, str] | None:
        """Summed server counts where every run has them, else the offline ones, else None."""
        runs = self.runs.get(mode, [])
        if runs and all(r.counts is not None for r in runs):
            total = SpecCounts()
            for r in runs:
                total += r.counts  # type: ignore[operator]
            return total, "server"
        if mode in self.offline_counts:
            return self.offline_counts[mode], "offline"
        return None

    @property
    def busy(self) -> bool:
        return any(r.other_cpu_share > BUSY_SHARE for runs in self.runs.values() for r in runs)

    @staticmethod
    def merge(cells: list[Cell]) -> list[Cell]:
        """One cell per (engine, workload, C): vLLM's settings run in separate passes."""
        merged: dict[tuple, Cell] = {}
        for cell in cells:
            key = (cell.engine, cell.workload, cell.concurrency)
            if key not in merged:
                merged[key] = cell
            else:
                for mode, runs in cell.runs.items():
                    merged[key].runs.setdefault(mode, []).extend(runs)
        return list(merged.values())

    def as_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("runs", "offline_counts")}
        modes = {}
        for mode, runs in self.runs.items():
            counts = self.counts(mode)
            modes[mode] = {
                "output_tokens_per_s": self.tokens_per_s(mode),
                "ratio_to_off": self.ratio(mode),
                "pair_ratios": self.pair_ratios(mode),
                "acceptance_rate": counts[0].acceptance_rate if counts else None,
                "least_request_acceptance": self.least_acceptance(mode),
                "mean_acceptance_length": counts[0].mean_acceptance_length if counts else None,
                "counts": dataclasses.asdict(counts[0]) if counts else None,
                "counts_source": counts[1] if counts else None,
                "runs": [dataclasses.asdict(r) | {"tok_s": r.output_tokens_per_s} for r in runs],
            }
        return out | {"modes": modes}


def busy_cpu_s() -> float:
    t = psutil.cpu_times()  # not steal (the hypervisor's) nor guest (already in user)
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def bench_serve(server, workload: Path, num_requests: int, c: int, out: Path) -> CellRun:
    """The first `num_requests` of `workload` to `server` (a vllm_compare Server), at most C in
    flight. The cell's other servers sit idle meanwhile; any CPU they take counts as other."""
    before = busy_cpu_s(), server.cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    cmd = [PAGEDLLM, "bench", "serve", "--base-url", server.url, "--served-model-name", MODEL_NAME]
    cmd += ["--workload", str(workload), "--num-requests", str(num_requests)]
    cmd += ["--max-concurrency", str(c), "--output-json", str(out), "--disable-tqdm"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    client = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_s = client.ru_utime + client.ru_stime - before[2].ru_utime - before[2].ru_stime
    other_s = busy_cpu_s() - before[0] - (server.cpu_s() - before[1]) - client_s
    # over the client's whole life, not the timed part only: its start-up is in other_s's span
    share = other_s / ((time.monotonic() - before[3]) * (os.cpu_count() or 1))
    report = json.loads(out.read_text())
    tpot = report.get("tpot_s") or {}
    rates = [
        r["accepted_draft_tokens"] / r["draft_tokens"]
        for r in report["requests"]
        if r.get("error") is None and r.get("draft_tokens")
    ]
    return CellRun(
        output_tokens=sum(r["output_tokens"] for r in report["requests"] if r.get("error") is None),
        elapsed_s=report["elapsed_s"],
        num_failed=report["num_failed"],
        tpot_p50_s=tpot.get("p50"),
        other_cpu_share=max(share, 0.0),
        least_acceptance=min(rates) if rates else None,
    )
