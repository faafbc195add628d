"""`pagedllm bench sweep`: the tuning rounds users do by hand, as one command.

For each setting of a grid (any engine flag; by default max_num_seqs x max_num_batched_tokens x
kv_cache_dtype x block_size, plus the defaults themselves) one engine process replays the same
requests (offline, all requests at t=0 unless --request-rate) and reports output tokens/s, TTFT p50/p95,
TPOT p50, the prefix-cache hit rate, preemptions and peak KV usage. Then: a table, JSON, a PNG of
throughput against TTFT p95 with the Pareto front marked, and the setting with the most throughput
within the SLOs, printed as the `pagedllm serve` command that runs it. --budget-minutes bounds the
whole sweep: settings not reached are listed as skipped.

The requests come from `pagedllm bench serve`'s dataset flags (datasets.py: `random`, ShareGPT JSON,
a single-turn JSONL workload), drawn once with the tokenizer and seed of the --set flags and handed
to every setting's process as one JSONL file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.bench.datasets import add_dataset_arguments, dataset_source, load_dataset_for
from pagedllm.config import EngineConfig
from pagedllm.workload import BenchRequest, write_requests

DEFAULT_GRID: dict[str, list[Any]] = {
    "max_num_seqs": [8, 16, 32, 64],
    "max_num_batched_tokens": [512, 2048, 8192],
    "kv_cache_dtype": ["auto", "int8"],
    "block_size": [16, 32],
}
DEFAULTS = "defaults"


@dataclass
class SettingResult:
    setting: dict[str, Any]
    output_throughput: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    tpot_p50_s: float = 0.0
    hit_rate: float = 0.0
    preemptions: int = 0
    peak_kv_usage: float = 0.0
    elapsed_s: float = 0.0
    error: str | None = None
    meets_slo: bool = False
    pareto: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataset_arguments(parser)
    parser.add_argument(
        "--grid",
        action="append",
        default=None,
        metavar="FLAG=V1,V2",
        help="an engine flag and its values, e.g. max_num_seqs=8,16,32 (repeatable; replaces the "
        "default grid: max_num_seqs 8,16,32,64 x max_num_batched_tokens 512,2048,8192 x "
        "kv_cache_dtype auto,int8 x block_size 16,32)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FLAG=VALUE", help="fixed for every run"
    )
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (inf: t=0)"
    )
    parser.add_argument("--slo-ttft-p95", type=_seconds, default=None, help="e.g. 2s or 500ms")
    parser.add_argument("--slo-tpot-p50", type=_seconds, default=None, help="e.g. 100ms")
    parser.add_argument(
        "--budget-minutes", type=float, default=30.0, help="stop starting settings after this"
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, metavar="PNG", help="throughput vs TTFT p95 (needs [plot])")
    parser.add_argument(
        "--seed", type=int, default=0, help="order of the settings (shuffled, defaults first)"
    )


def _seconds(text: str) -> float:
    text = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def parse_grid(items: list[str] | None) -> dict[str, list[Any]]:
    if not items:
        return dict(DEFAULT_GRID)
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--grid {item!r}: expected FLAG=V1,V2,...")
        grid[name.strip().replace("-", "_")] = [_value(v) for v in values.split(",")]
    return grid


def _value(text: str) -> Any:
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def settings_of(grid: dict[str, list[Any]], seed: int) -> list[dict[str, Any]]:
    """The defaults first, then every combination in a shuffled order: a budget cut short still
    samples the whole grid rather than one corner of it."""
    names = list(grid)
    combos = [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]
    random.Random(seed).shuffle(combos)
    return [{}, *combos]


def sweep_requests(args: argparse.Namespace, fixed: dict[str, Any]) -> list[BenchRequest]:
    """The requests every setting replays: the dataset flags' set, as `bench serve` loads it with
    the same --model, --tokenizer and --seed (here --set flags)."""
    try:
        items, _ = load_dataset_for(args, EngineConfig(**fixed))
    except (ValueError, OSError, TypeError) as error:
        raise SystemExit(f"pagedllm bench sweep: {error}") from None
    if not all(isinstance(item, BenchRequest) for item in items):
        raise SystemExit(
            f"pagedllm bench sweep: {args.dataset_path} holds conversations; the sweep replays "
            "single-turn requests (use `pagedllm bench prefix` for conversations)"
        )
    return items  # type: ignore[return-value]


def main(args: argparse.Namespace) -> None:
    grid = parse_grid(args.grid)
    fixed = {k.replace("-", "_"): _value(v) for k, v in (s.partition("=")[::2] for s in args.set)}
    with tempfile.TemporaryDirectory(prefix="pagedllm-sweep-") as folder:
        requests_path = Path(folder) / "requests.jsonl"
        write_requests(requests_path, sweep_requests(args, fixed))
        _sweep(args, grid, fixed, requests_path)


def _sweep(
    args: argparse.Namespace, grid: dict[str, list[Any]], fixed: dict[str, Any], requests_path: Path
) -> None:
    settings = settings_of(grid, args.seed)
    deadline = time.monotonic() + args.budget_minutes * 60
    results: list[SettingResult] = []
    start = time.monotonic()
    for index, setting in enumerate(settings):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        label = _label(setting)
        print(f"[{index + 1}/{len(settings)}] {label} ({left / 60:.1f} min of budget left)", flush=True)
        result = run_setting({**fixed, **setting}, requests_path, args.request_rate)
        result.setting = setting
        results.append(result)
        print(f"    {_summary(result)}", flush=True)
    skipped = settings[len(results) :]
    mark(results, args.slo_ttft_p95, args.slo_tpot_p50)
    print(report(results, skipped, args, time.monotonic() - start, fixed))
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(
                {
                    "results": [asdict(r) for r in results],
                    "skipped": skipped,
                    "recommended": _recommended(results),
                    "serve_command": serve_command(_recommended(results), fixed),
                },
                indent=2,
            )
        )
    if args.plot:
        save_plot(results, args.plot)


def run_setting(setting: dict[str, Any], requests_path: Path, request_rate: float) -> SettingResult:
    """One engine process: a fresh process per setting, so memory and threads start clean."""
    command = [sys.executable, "-m", "pagedllm.bench.sweep_run", "--workload", str(requests_path)]
    command += ["--setting", json.dumps(setting), "--request-rate", str(request_rate)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return SettingResult(setting, error=error)
    return SettingResult(setting, **json.loads(done.stdout.strip().splitlines()[-1]))


def mark(results: list[SettingResult], slo_ttft_p95: float | None, slo_tpot_p50: float | None) -> None:
    ok = [r for r in results if r.error is None]
    for r in ok:
        r.meets_slo = (slo_ttft_p95 is None or r.ttft_p95_s <= slo_ttft_p95) and (
            slo_tpot_p50 is None or r.tpot_p50_s <= slo_tpot_p50
        )
        # Pareto: no other setting is at least as fast with a TTFT p95 at least as low, and better in one
        r.pareto = not any(
            o.output_throughput >= r.output_throughput
            and o.ttft_p95_s <= r.ttft_p95_s
            and (o.output_throughput > r.output_throughput or o.ttft_p95_s < r.ttft_p95_s)
            for o in ok
        )


def _recommended(results: list[SettingResult]) -> dict[str, Any] | None:
    within = [r for r in results if r.error is None and r.meets_slo]
    return max(within, key=lambda r: r.output_throughput).setting if within else None


def serve_command(setting: dict[str, Any] | None, fixed: dict[str, Any]) -> str | None:
    if setting is None:
        return None
    flags = []
    for name, value in {**fixed, **setting}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return shlex.join(["pagedllm", "serve", *flags])


def report(
    results: list[SettingResult],
    skipped: list[dict],
    args: argparse.Namespace,
    elapsed: float,
    fixed: dict[str, Any],
) -> str:
    lines = [
        "",
        f"sweep of {dataset_source(args)}: {len(results)} settings in {elapsed / 60:.1f} min"
        + (f", {len(skipped)} skipped (budget)" if skipped else ""),
        f"{'setting':58} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'hit':>6} "
        f"{'preempt':>7} {'peak KV':>7}",
    ]
    for r in sorted(results, key=lambda r: -r.output_throughput):
        if r.error is not None:
            lines.append(f"{_label(r.setting):58} failed: {r.error}")
            continue
        marks = ("*" if r.pareto else " ") + ("" if r.meets_slo else " (misses SLO)")
        lines.append(
            f"{_label(r.setting):58} {r.output_throughput:7.1f} {r.ttft_p50_s:8.2f}s {r.ttft_p95_s:8.2f}s "
            f"{r.tpot_p50_s * 1e3:7.1f}ms {r.hit_rate:6.1%} {r.preemptions:7} {r.peak_kv_usage:7.1%}{marks}"
        )
    lines.append("* on the Pareto front of throughput vs TTFT p95")
    best = _recommended(results)
    base = next((r for r in results if not r.setting and r.error is None), None)
    if best is None:
        lines.append("no setting meets the SLO; loosen it or widen the grid")
    else:
        chosen = next(r for r in results if r.setting == best)
        gain = f" ({chosen.output_throughput / base.output_throughput:.2f}x the defaults" if base else ""
        if base is not None:
            gain += ", which miss the SLO)" if not base.meets_slo else ")"
        lines.append(f"recommended: {_label(best)}: {chosen.output_throughput:.1f} tokens/s{gain}")
        lines.append(f"  {serve_command(best, fixed)}")
    return "\n".join(lines)


def save_plot(results: list[SettingResult], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagedllm[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    figure, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([r.ttft_p95_s for r in ok], [r.output_throughput for r in ok], c="grey", label="setting")
    front = sorted((r for r in ok if r.pareto), key=lambda r: r.ttft_p95_s)
    ax.plot(
        [r.ttft_p95_s for r in front],
        [r.output_throughput for r in front],
        "o-",
        c="C1",
        label="Pareto front",
    )
    for r in front:
        ax.annotate(_label(r.setting), (r.ttft_p95_s, r.output_throughput), fontsize=7)
    best = next((r for r in ok if r.setting == _recommended(results)), None)
    if best is not None:
        ax.scatter(
            [best.ttft_p95_s], [best.output_throughput], marker="*", s=220, c="C2", label="recommended"
        )
        ax.annotate(_label(best.setting), (best.ttft_p95_s, best.output_throughput), fontsize=7)
    ax.set_xlabel("TTFT p95 (s)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _label(setting: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items()) or DEFAULTS


def _summary(r: SettingResult) -> str:
    if r.error is not None:
        return f"failed: {r.error}"
    return (
        f"{r.output_throughput:.1f} tok/s, TTFT p95 {r.ttft_p95_s:.2f} s, "
        f"TPOT p50 {r.tpot_p50_s * 1e3:.1f} ms, {r.preemptions} preemptions, peak KV {r.peak_kv_usage:.0%}"
    )
