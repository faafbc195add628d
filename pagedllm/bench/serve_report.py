"""What `pagedllm bench serve` prints and writes: vLLM's table and JSON keys, then ours.

Our keys (`output_throughput`, `elapsed_s`, `num_requests`, `num_failed`, `prefix_hit_rate`, the
`ttft_s` / `tpot_s` / `e2e_s` percentile dicts in seconds, `requests`) keep their meaning for the
scripts in benchmarks/ that read them; vLLM's sit beside them where the two mean the same.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import numpy as np

from pagedllm.bench.datasets import dataset_name
from pagedllm.bench.serve_metrics import QUANTILES, ServeResult
from pagedllm.bench.throughput import git_sha

_HEADERS = {
    "ttft": ("TTFT", "Time to first token"),
    "tpot": ("TPOT", "Time per output token (after the first)"),
    "itl": ("ITL", "Inter-token latency"),
    "e2el": ("E2EL", "End-to-end latency"),
}


def build_report(
    args: argparse.Namespace,
    url: str,
    model: str,
    tokenizer_id: str | None,
    num_prompts: int,
    result: ServeResult,
    offline: float | None,
) -> tuple[str, dict]:
    """The printed table and the JSON: vLLM's keys first, then ours (which older readers use)."""
    slos = dict(args.goodput) if args.goodput else None
    summary = result.summary(args.percentile_metrics, args.metric_percentiles, slos)
    hit_rate = result.prefix_hit_rate
    lines = [
        summary_table(
            summary,
            args.percentile_metrics,
            args.metric_percentiles,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            prefix_hit_rate=hit_rate,
            draft_acceptance_rate=result.draft_acceptance_rate,
        )
    ]
    if failed := [r for r in result.records if r.error]:
        lines.append(f"first error: {failed[0].error}")
    if offline is not None:
        lines.append(
            f"offline engine, same requests and concurrency: {offline:.1f} output tokens/s; "
            f"server/offline: {result.output_throughput / offline:.2f}x"
        )
    report = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summary,
        "base_url": url,
        "model": model,
        "dataset_name": dataset_name(args),
        "workload": args.dataset_path,
        "concurrency": args.max_concurrency,
        "git": git_sha(),
        "num_requests": len(result.records),
        "num_failed": len(failed),
        "elapsed_s": result.elapsed_s,
        "prefix_hit_rate": hit_rate,
        "draft_acceptance_rate": result.draft_acceptance_rate,
        "ttft_s": result.quantiles("ttft_s"),
        "tpot_s": result.quantiles("tpot_s"),
        "e2e_s": result.quantiles("e2e_s"),
        "offline_output_throughput": offline,
        "server_offline_ratio": result.output_throughput / offline if offline else None,
        "requests": [
            {k: v for k, v in asdict(r).items() if k != "itl_s"} | {"tpot_s": r.tpot_s}
            for r in result.records
        ],
    }
    if args.save_detailed:
        report |= {
            "input_lens": [r.prompt_tokens for r in result.records],
            "output_lens": [r.output_tokens for r in result.records],
            "ttfts": [r.ttft_s for r in result.records],
            "itls": [r.itl_s for r in result.records],
            "latencies": [r.e2e_s for r in result.records],
            "start_times": [r.start_s for r in result.records],
            "errors": [r.error for r in result.records],
        }
    return "\n".join(lines), report


def result_path(args: argparse.Namespace, report: dict) -> Path:
    """--result-filename, else vLLM's naming: backend-RATEqps[-concurrencyN]-MODEL-DATE.json."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (
        f"openai-{args.request_rate}qps{concurrency}-{report['model_id'].split('/')[-1]}-{report['date']}.json"
    )
    return Path(args.result_dir or ".") / name


def save_plot(result: ServeResult, path: str, title: str) -> None:
    try:  # here, not at the top: only --plot needs it, and it is slow to import
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagedllm[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (label, name, scale) in zip(
        axes,
        (("TTFT (ms)", "ttft_s", 1e3), ("TPOT (ms)", "tpot_s", 1e3), ("E2E latency (s)", "e2e_s", 1.0)),
        strict=True,
    ):
        values = [v * scale for r in result.ok if (v := getattr(r, name)) is not None]
        if values:
            ax.hist(values, bins=30, color="tab:blue", alpha=0.8)
            for q, style in zip(QUANTILES, (":", "--", "-"), strict=True):
                ax.axvline(np.percentile(values, q), color="black", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def summary_table(
    summary: dict,
    metrics: list[str],
    percentiles: list[float],
    *,
    max_concurrency: int | None,
    request_rate: float,
    prefix_hit_rate: float | None,
    draft_acceptance_rate: float | None = None,
) -> str:
    """The summary as `vllm bench serve` lays it out: one figure a line, a block per latency."""

    def row(label: str, value: object) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else "n/a" if value is None else str(value)
        return f"{label:<40} {text}"

    lines = [
        " Serving benchmark ".center(50, "="),
        row("Requests completed:", summary["completed"]),
        row("Requests failed:", summary["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(row("Max concurrency (--max-concurrency):", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(row("Request rate (set, req/s):", request_rate))
    lines += [
        row("Duration (s):", summary["duration"]),
        row("Input tokens:", summary["total_input_tokens"]),
        row("Output tokens:", summary["total_output_tokens"]),
        row("Requests/s:", summary["request_throughput"]),
    ]
    if summary["request_goodput"] is not None:
        lines.append(row("Goodput (req/s within the SLOs):", summary["request_goodput"]))
    lines += [
        row("Output tokens/s:", summary["output_throughput"]),
        row("Most output tokens in one second:", summary["max_output_tokens_per_s"]),
        row("Most in flight at once (measured):", summary["max_concurrent_requests"]),
        row("Total (input + output) tokens/s:", summary["total_token_throughput"]),
        row("Prefix cache hit rate:", None if prefix_hit_rate is None else f"{prefix_hit_rate:.1%}"),
    ]
    if draft_acceptance_rate is not None:
        lines.append(row("Draft acceptance rate:", f"{draft_acceptance_rate:.1%}"))
    for metric in metrics:
        short, header = _HEADERS[metric]
        lines.append(f" {header} ".center(50, "-"))
        lines.append(row(f"Mean {short} (ms):", summary[f"mean_{metric}_ms"]))
        lines.append(row(f"Median {short} (ms):", summary[f"median_{metric}_ms"]))
        lines += [row(f"P{q:g} {short} (ms):", summary[f"p{q:g}_{metric}_ms"]) for q in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)
