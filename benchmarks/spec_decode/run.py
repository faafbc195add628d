"""Speculative decoding on vs off, served: output tokens/s, their ratio, and acceptance (issue 24).

    .venv/bin/python benchmarks/spec_decode/run.py [--concurrency 1 4 16]
        [--workloads grounded code chat] [--methods ngram suffix]
        [--speculative-config JSON] [--vllm-venv $VLLM_VENV]

Workloads (workloads.py, written to OUT/workloads/): input-grounded answers, code edits and
open-ended chat, as chat messages, greedy, 256 tokens each with EOS ignored. pagedllm serves the
default model's HF folder (benchmarks/vllm_compare/write_hf_model.py) from one server per setting,
all started at once and left up: off, and one per method (ngram by default), each with room for
the largest concurrency, 32-token blocks and prefix caching (as vllm_compare). For each
concurrency C and workload, the first max(8, 2C) requests go through `pagedllm bench serve` at
most C in flight, to the servers in turn (off, on, off, on: --repeats pairs), so drift on the
host falls on both alike, and both servers see the same request history (their prefix caches hold
the same). Printed per cell: output tokens/s off and on, the ratio of the sums (and each pair's),
the acceptance rate and mean acceptance length (acceptance.py: the server's /metrics where it
exports spec_decode counters, else the offline engine on the same requests, marked "offline").

With --vllm-venv, vLLM's CPU build serves the same folder and workloads with the same
--speculative-config, one server at a time (its start takes ~90 s and 4+ GiB): off, then each
method, each through all cells; its ratios therefore come from runs minutes apart. The host's
CPU and flags, the git sha and the dtype head the output; everything goes to OUT/results.json,
logs to OUT/*.log.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from acceptance import offline_counts, scrape  # noqa: E402
from cells import MODEL_NAME, PAGEDLLM, Cell, bench_serve  # noqa: E402
from report import print_header, print_table  # noqa: E402
from workloads import MAX_TOKENS, WORKLOADS, write_workload  # noqa: E402

from pagedllm.cpu_features import describe_host  # noqa: E402


def _vllm_compare():
    """benchmarks/vllm_compare/run.py (its Server, dtype choice, model folder), loaded under its
    own name: this file is a run.py too."""
    path = HERE.parent / "vllm_compare" / "run.py"
    spec = importlib.util.spec_from_file_location("vllm_compare_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vllm_compare = _vllm_compare()
Server, TCMALLOC = vllm_compare.Server, vllm_compare.TCMALLOC

DEFAULT_CONFIGS = {
    # prompt_lookup_* written out: vLLM's and pagedllm's defaults differ, the runs must not
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix"},
}
KV_CACHE_GIB = 2


def spec_configs(methods: list[str], override: str | None) -> dict[str, dict]:
    """Method -> its --speculative-config; an override replaces its method's default (and adds
    the method where --methods lacks it)."""
    configs = {m: DEFAULT_CONFIGS[m] for m in methods}
    if override:
        config = json.loads(override)
        if not isinstance(config, dict) or "method" not in config:
            raise SystemExit('--speculative-config: a JSON object with a "method", as the servers take')
        configs[config["method"]] = config
    return configs


def server_cmd(engine: str, args: argparse.Namespace, config: dict | None, port: int) -> tuple[list, dict]:
    """The same settings for both engines: dtype, room for max(C) requests, 32-token blocks,
    prefix caching, KV_CACHE_GIB of KV cache; `config` is the --speculative-config (None: off)."""
    common = ["--served-model-name", MODEL_NAME, "--dtype", args.dtype, "--max-num-seqs"]
    common += [str(max(args.concurrency)), "--block-size", "32", "--enable-prefix-caching"]
    common += ["--port", str(port)] + (["--speculative-config", json.dumps(config)] if config else [])
    if engine == "pagedllm":
        cmd = [PAGEDLLM, "serve", str(args.model_dir), *common]
        return [*cmd, "--kv-cache-memory-bytes", f"{KV_CACHE_GIB}GiB"], {}
    cores = args.cores or os.cpu_count() or 1
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",  # else it keeps a core for itself
        "LD_PRELOAD": f"{TCMALLOC}:{args.vllm_venv}/lib/libiomp5.so",
    }
    return [f"{args.vllm_venv}/bin/vllm", "serve", str(args.model_dir), *common, "--host", "127.0.0.1"], env


def start(engine: str, mode: str, args: argparse.Namespace, config: dict | None, port: int) -> Server:
    cmd, env = server_cmd(engine, args, config, port)
    server = Server(f"{engine}_{mode}", cmd, os.environ | env, args.out / f"{engine}_{mode}.log", port)
    print(f"starting {server.name}: {' '.join(cmd)}", flush=True)
    try:
        ready_s = server.start(args.ready_timeout)
    except RuntimeError:
        server.stop()  # one that never answered may still run
        raise
    print(f"{server.name} ready in {ready_s:.0f} s; warm-up: {server.warm_up()!r}", flush=True)
    return server


def num_requests(args: argparse.Namespace, c: int) -> int:
    return args.num_requests or max(8, 2 * c)


def run_cell(
    engine: str, servers: dict[str, Server], workload: str, c: int, args: argparse.Namespace
) -> Cell:
    """--repeats rounds of every server in turn on the same requests, C in flight."""
    cell = Cell(engine, workload, c, num_requests(args, c))
    path = args.out / "workloads" / f"{workload}.jsonl"
    for rep in range(args.repeats):
        for mode, server in servers.items():
            before = scrape(server.url) if mode != "off" else None
            out = args.out / f"{engine}_{mode}_{workload}_c{c}_r{rep}.json"
            run = bench_serve(server, path, cell.num_requests, c, out)
            if before is not None and (after := scrape(server.url)) is not None:
                run = run.with_counts(after - before, "server")
            cell.runs.setdefault(mode, []).append(run)
            print(
                f"  {engine} {workload} C={c} {mode} #{rep}: {run.output_tokens_per_s:.1f} tok/s", flush=True
            )
    return cell


def offline_acceptance(cell: Cell, mode: str, config: dict, args: argparse.Namespace) -> None:
    """Where the server gave no counts: the offline engine's, once, on the cell's requests."""
    flags = ["--model", str(args.model_dir), "--dtype", args.dtype, "--block-size", "32"]
    flags += ["--kv-cache-memory-bytes", f"{KV_CACHE_GIB}GiB"]
    flags += ["--max-num-seqs", str(max(args.concurrency)), "--speculative-config", json.dumps(config)]
    workload = args.out / "workloads" / f"{cell.workload}.jsonl"
    out = args.out / f"offline_{mode}_{cell.workload}_c{cell.concurrency}.json"
    counts = offline_counts(workload, cell.num_requests, cell.concurrency, flags, out)
    cell.offline_counts[mode] = counts


def run_engine(engine: str, configs: dict[str, dict], args: argparse.Namespace) -> list[Cell]:
    """pagedllm: every server up at once, runs alternated; vLLM: one server at a time."""
    modes: dict[str, dict | None] = {"off": None, **configs}
    cells: list[Cell] = []
    groups = [list(modes)] if engine == "pagedllm" else [[m] for m in modes]
    for group in groups:
        servers: dict[str, Server] = {}
        try:
            for i, mode in enumerate(group):
                try:
                    servers[mode] = start(engine, mode, args, modes[mode], args.port + i)
                except RuntimeError as error:  # a method this build lacks: say so, go on without it
                    if mode == "off":
                        raise
                    print(f"{engine} {mode} did not start:\n{error}", flush=True)
            for c in args.concurrency:
                for workload in args.workloads:
                    cells.append(run_cell(engine, servers, workload, c, args))
        finally:
            for server in servers.values():
                server.stop()
    cells = Cell.merge(cells)
    for cell in cells:
        for mode in cell.runs:
            if (
                mode != "off"
                and cell.counts(mode) is None
                and engine == "pagedllm"
                and args.offline_acceptance
            ):
                offline_acceptance(cell, mode, configs[mode], args)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--methods", nargs="+", choices=sorted(DEFAULT_CONFIGS), default=["ngram"])
    parser.add_argument("--speculative-config", help="JSON replacing its method's default config")
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs per cell")
    parser.add_argument("--num-requests", type=int, help="per run (default: max(8, 2C)); short checks")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="per request; short checks")
    parser.add_argument("--vllm-venv", help="also vLLM's CPU build (benchmarks/vllm_compare/setup_vllm.sh)")
    parser.add_argument(
        "--no-offline-acceptance",
        dest="offline_acceptance",
        action="store_false",
        help="where the server exports no spec_decode counters, print none rather than run the "
        "offline engine once more per cell for them",
    )
    parser.add_argument(
        "--model", type=Path, help="an HF folder both engines load (default: the embedded SmolLM2-135M)"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: from the CPU flags")
    parser.add_argument("--cores", type=int, help="vLLM's OMP binding 0..N-1 (default: all)")
    parser.add_argument("--port", type=int, default=8300, help="first of the ports the servers take")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "results/spec_decode")
    args = parser.parse_args()
    args.out = args.out.resolve()
    host = vllm_compare.host_info()
    args.dtype, why = (
        (args.dtype, "given with --dtype") if args.dtype else vllm_compare.pick_dtype(host["flags"])
    )
    configs = spec_configs(args.methods, args.speculative_config)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    results: dict = {
        "host": describe_host(),
        "git": git.stdout.strip(),
        "dtype": args.dtype,
        "dtype_reason": why,
        "configs": configs,
        "max_tokens": args.max_tokens,
        "model": str(args.model or "SmolLM2-135M-Instruct (embedded)"),
        "argv": sys.argv,
    }
    print_header(results)
    for workload in args.workloads:
        write_workload(workload, args.out / "workloads", args.max_tokens)
    args.model_dir = args.model or vllm_compare.write_hf_model(args.out / f"model-{args.dtype}", args.dtype)
    started = time.monotonic()
    engines = ["pagedllm"] + (["vllm"] if args.vllm_venv else [])
    for engine in engines:
        try:
            cells = run_engine(engine, configs, args)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as error:
            if engine == "pagedllm":
                raise
            results[f"{engine}_error"] = str(error)  # pagedllm's table stands without it
            print(f"\n{engine} failed: {error}", flush=True)
            continue
        results[engine] = [cell.as_dict() for cell in cells]
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        print_table(engine, cells, list(configs))
    print(f"\nwall {(time.monotonic() - started) / 60:.1f} min; all figures: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
