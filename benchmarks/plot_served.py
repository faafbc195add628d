"""Plots of a served comparison (pagedllm beside vLLM's CPU build), drawn from its JSON.

    .venv/bin/python benchmarks/plot_served.py results/vllm_compare/results.json --name NAME
    .venv/bin/python benchmarks/plot_served.py docs/benchmarks/data/NAME.json    # redraw

The first form keeps the figures of `benchmarks/vllm_compare/run.py`'s results.json (host, dtype,
git, and per server and requests in flight: throughput, TTFT / TPOT / E2E percentiles, time to
ready, peak RSS; no logs, commands or local paths) as docs/benchmarks/data/NAME.json, then draws
from that file, so every committed picture can be drawn again from a committed file:
- NAME_throughput.png: output tokens/s against requests in flight, one line per engine and workload;
- NAME_latency.png: TTFT and TPOT p50 / p95 against requests in flight, per engine (first workload;
  drawn where the run has three settings of in flight or more). TTFT includes the wait for a seat:
  run.py sends every request at t=0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs/benchmarks/data"
PLOTS = REPO / "docs/benchmarks/plots"
ENGINES = {"pagedllm": ("pagedllm", "tab:blue"), "vllm": ("vLLM CPU", "tab:orange")}
CELL_KEYS = ("output_throughput", "elapsed_s", "num_requests", "num_failed", "prefix_hit_rate")
CELL_KEYS += ("ttft_s", "tpot_s", "e2e_s", "prompt_tokens", "output_tokens")
SERVER_KEYS = ("ready_s", "peak_rss_gib")


def kept_figures(results: dict) -> dict:
    """The figures of a run.py results.json, without logs, commands or paths."""
    kept = {
        k: results[k]
        for k in ("host", "dtype", "git", "model", "workloads", "concurrencies", "note")
        if k in results
    }
    for engine in ENGINES:
        runs = results.get(engine) or {}
        kept[engine] = {
            c: {k: run[k] for k in SERVER_KEYS}
            | {"cells": {w: _kept_cell(cell) for w, cell in run["cells"].items()}}
            for c, run in runs.items()
        }
    return kept


def _kept_cell(cell: dict) -> dict:
    return {k: cell[k] for k in CELL_KEYS if k in cell}


def title(figures: dict) -> str:
    host = figures["host"]
    return (
        f"{figures['model']}, {figures['dtype']}, {host['cpu']} ({host['cores']} cores), git {figures['git']}"
    )


def series(figures: dict, engine: str, workload: str, pick) -> tuple[list[int], list[float]]:
    runs = figures.get(engine) or {}
    points = sorted(
        (int(c), pick(run["cells"][workload])) for c, run in runs.items() if workload in run["cells"]
    )
    return [c for c, _ in points], [v for _, v in points]


def _throughput(figures: dict, engine: str, workload: str, in_flight: int) -> float:
    run = (figures.get(engine) or {}).get(str(in_flight))
    return run["cells"][workload]["output_throughput"] if run and workload in run["cells"] else 0.0


def draw(figures: dict, name: str) -> list[Path]:
    import matplotlib  # here: only drawing needs it (the [plot] extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    PLOTS.mkdir(parents=True, exist_ok=True)
    figure, ax = plt.subplots(figsize=(8, 5))
    if len(figures["concurrencies"]) >= 3:  # a curve per engine and workload
        for engine, (label, color) in ENGINES.items():
            for workload, style in zip(figures["workloads"], ["-", "--", ":"], strict=False):
                xs, ys = series(figures, engine, workload, lambda cell: cell["output_throughput"])
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{label}, {workload}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(figures["concurrencies"], [str(c) for c in figures["concurrencies"]])
        ax.set_xlabel("requests in flight (--max-num-seqs; all sent at t=0)")
    else:  # bars side by side per workload and in flight, the ratio above them
        groups = [(w, c) for w in figures["workloads"] for c in figures["concurrencies"]]
        for offset, (engine, (label, color)) in zip((-0.2, 0.2), ENGINES.items(), strict=True):
            heights = [_throughput(figures, engine, w, c) for w, c in groups]
            ax.bar([i + offset for i in range(len(groups))], heights, 0.4, color=color, label=label)
        for i, (w, c) in enumerate(groups):
            ours, theirs = _throughput(figures, "pagedllm", w, c), _throughput(figures, "vllm", w, c)
            if ours and theirs:
                ax.annotate(f"{ours / theirs:.2f}x", (i, max(ours, theirs)), ha="center", va="bottom")
        ax.set_xticks(range(len(groups)), [f"{w}\n{c} in flight" for w, c in groups], fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title(figures), fontsize=9)
    throughput = PLOTS / f"{name}_throughput.png"
    figure.tight_layout()
    figure.savefig(throughput, dpi=110)
    plt.close(figure)

    if len(figures["concurrencies"]) < 3:
        return [throughput]
    workload = figures["workloads"][0]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (metric, label) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT")), strict=True):
        for engine, (engine_label, color) in ENGINES.items():
            for q, style in (("p50", "-"), ("p95", "--")):
                xs, ys = series(figures, engine, workload, lambda cell, m=metric, q=q: cell[m][q] * 1e3)
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{engine_label} {q}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(figures["concurrencies"], [str(c) for c in figures["concurrencies"]])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(
            f"{label} (ms, log scale)" + (", with the wait for a seat" if metric == "ttft_s" else "")
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        ax.set_title(f"{label}, {workload}")
    figure.suptitle(title(figures), fontsize=9)
    latency = PLOTS / f"{name}_latency.png"
    figure.tight_layout()
    figure.savefig(latency, dpi=110)
    plt.close(figure)
    return [throughput, latency]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="run.py's results.json, or a file in docs/benchmarks/data")
    parser.add_argument("--name", help="keep the figures as docs/benchmarks/data/NAME.json (default: redraw)")
    args = parser.parse_args()
    figures = kept_figures(json.loads(args.results.read_text()))
    name = args.name or args.results.stem
    if args.name:
        DATA.mkdir(parents=True, exist_ok=True)
        kept = DATA / f"{name}.json"
        kept.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"kept {kept.relative_to(REPO)}")
    for path in draw(figures, name):
        print(f"drew {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
