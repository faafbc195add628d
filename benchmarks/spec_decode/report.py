"""What run.py prints: the host, git and dtype first (every figure needs them), then one markdown
table per engine with a row per workload and concurrency."""

from __future__ import annotations

import json

from cells import Cell


def print_header(results: dict) -> None:
    print(f"host: {results['host']}")
    print(f"git {results['git']}; dtype {results['dtype']} ({results['dtype_reason']})")
    print(f"{results['max_tokens']} tokens per request (EOS ignored), greedy")
    for method, config in results["configs"].items():
        print(f"{method}: --speculative-config '{json.dumps(config)}'")
    print(flush=True)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_table(engine: str, cells: list[Cell], methods: list[str]) -> None:
    """Output tokens/s off and per method, on/off of the sums (each pair's ratio beside it), and
    the acceptance figures, marked where the offline engine supplied them, with the lowest
    acceptance of one request (the one a closed loop of a few requests waits for)."""
    header = ["workload", "in flight", "requests", "off tok/s"]
    for m in methods:
        header += [f"{m} tok/s", f"{m} / off", "per pair", "acceptance", "mean acc. len", "least request"]
    print(f"\n{engine}: output tokens/s, speculation off vs on")
    print(_row(*header))
    print(_row(*["---"] * len(header)))
    for cell in cells:
        row = [cell.workload, cell.concurrency, cell.num_requests, _fmt(cell.tokens_per_s("off"), ".1f")]
        for m in methods:
            counts = cell.counts(m)
            mark = " (offline)" if counts and counts[1] == "offline" else ""
            rate = counts[0].acceptance_rate if counts else None
            length = counts[0].mean_acceptance_length if counts else None
            pairs = " ".join(f"{r:.2f}" for r in cell.pair_ratios(m)) or "-"
            row += [_fmt(cell.tokens_per_s(m), ".1f"), _fmt(cell.ratio(m), ".2f"), pairs]
            row += [_fmt(rate, ".2f") + mark, _fmt(length, ".2f"), _fmt(cell.least_acceptance(m), ".2f")]
        print(_row(*row) + (" other processes busy: noisy" if cell.busy else ""), flush=True)
