"""pagedllm vs vLLM's CPU build, one server at a time on the same HF folder, driven by one client.

    .venv/bin/python benchmarks/vllm_compare/run.py            # 3 workloads x 8 and 32 in flight
    .venv/bin/python benchmarks/vllm_compare/run.py --quick    # mixed at 8 in flight only
    .venv/bin/python benchmarks/vllm_compare/run.py --workload mixed --concurrency 1 4 8 16 32  # a curve

Each server starts with --max-num-seqs C (C = requests in flight), the same dtype, block size 32,
prefix caching on and 4 GiB of KV cache, and gets the same `pagedllm bench serve` command: every
request of a workload sent at t=0, greedy, EOS ignored. Workloads run in the same order on both,
on one start of the server per C. Printed: the host's CPU and flags, the dtype, each server's
time to ready and peak RSS (summed over its processes), then a markdown table of output tokens/s
and TPOT p50; everything goes to OUT/results.json, server logs to OUT/*.log.

Where vLLM cannot be set up or started here, it says why and puts pagedllm's figures beside
transformers' (static batches of 8, measured live) and the vLLM figures in
../shared/peers/README.md, which come from another host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from write_hf_model import write_hf_model  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
MODEL_NAME = "SmolLM2-135M-Instruct"
PAGEDLLM = str(REPO / ".venv/bin/pagedllm")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# ../shared/peers/README.md, "Figures measured here" (another host: Intel, AVX-512-BF16 + AMX)
README_FIGURES = {
    "mixed": {"transformers static batch 8": 26.5, "vLLM 8": 129.5, "vLLM 32": 270.4},
    "shared_prefix": {"transformers static batch 8": 49.3, "vLLM 8": 148.3, "vLLM 32": 462.5},
    "decode_heavy": {"transformers static batch 8": 78.4, "vLLM 8": 159.0, "vLLM 32": 369.4},
}


def host_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", "?"),
        "cores": os.cpu_count(),
        "flags": {f: f in flags for f in FLAGS},
    }


def pick_dtype(has: dict[str, bool]) -> tuple[str, str]:
    if has["avx512_bf16"] or has["amx_bf16"]:
        return "bfloat16", "the CPU has avx512_bf16 or amx_bf16"
    return "float32", "no avx512_bf16/amx_bf16 (vLLM CPU's bfloat16 needs AVX-512), so float32 on both"


class Server:
    """One server process group: started, waited for, RSS sampled, stopped."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, port: int) -> None:
        self.name, self.cmd, self.env, self.log, self.port = name, cmd, env, log, port
        self.url = f"http://127.0.0.1:{port}"
        self.peak_rss = 0
        self._stop_sampling = threading.Event()

    def start(self, timeout_s: float) -> float:
        """Starts the server; returns seconds until /health answered. RuntimeError if it died."""
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", self.port)) == 0:
                raise SystemExit(f"port {self.port} is taken: stop what listens there or pass --port")
        start = time.monotonic()
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        threading.Thread(target=self._sample_rss, daemon=True).start()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server's live processes."""
        total = 0.0
        for p in self._tree():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def _sample_rss(self) -> None:
        while not self._stop_sampling.wait(0.5):
            try:
                procs = self._tree()
            except psutil.Error:
                continue
            rss = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    rss += p.memory_info().rss
            self.peak_rss = max(self.peak_rss, rss)

    def warm_up(self) -> str:
        """One short greedy request that shares no prefix with the workloads (first-request costs);
        returns its text, which should read the same on both servers (same weights)."""
        body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        response = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    def stop(self) -> None:
        self._stop_sampling.set()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def log_tail(self, n: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def log_lines(self, *needles: str) -> list[str]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [line.strip() for line in lines if any(n in line for n in needles)]


def server_cmd(name: str, args, model_dir: Path, dtype: str, c: int) -> tuple[list[str], dict]:
    """The same settings for both: dtype, C in flight, 32-token blocks, prefix caching, 4 GiB of KV."""
    common = ["--served-model-name", MODEL_NAME, "--dtype", dtype, "--max-num-seqs", str(c)]
    common += ["--block-size", "32", "--enable-prefix-caching", "--port", str(args.port)]
    if name == "pagedllm":
        cmd = [PAGEDLLM, "serve", str(model_dir), *common, "--kv-cache-memory-bytes", "4GiB"]
        return cmd, dict(os.environ)
    env = os.environ | {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # by default it keeps core 1 for itself
        "LD_PRELOAD": f"{TCMALLOC}:{args.vllm_venv}/lib/libiomp5.so",
    }
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, for the hit rate
    cmd = [f"{args.vllm_venv}/bin/vllm", "serve", str(model_dir), *common, "--host", "127.0.0.1"]
    return [*cmd, "--enable-prompt-tokens-details"], env


def num_requests_args(args) -> list[str]:
    return ["--num-requests", str(args.num_requests)] if args.num_requests else []


def busy_cpu_s() -> float:
    t = psutil.cpu_times()  # not steal (the hypervisor's) nor guest (already in user)
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def bench(server: Server, workload: str, args, out: Path, c: int) -> dict:
    """One `pagedllm bench serve` run; also the CPU seconds that processes other than the
    server and the client took meanwhile (another job on the host spoils the figures)."""
    path = out / f"{server.name}_{workload}_c{c}.json"
    before = busy_cpu_s(), server.cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    # no --concurrency: every request at t=0, the server's --max-num-seqs sets how many run
    cmd = [PAGEDLLM, "bench", "serve", "--base-url", server.url, "--served-model-name", MODEL_NAME]
    cmd += ["--workload", f"{args.workloads}/{workload}.jsonl", "--output-json", str(path)]
    cmd += num_requests_args(args)
    subprocess.run(cmd, check=True)
    client = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_s = client.ru_utime + client.ru_stime - before[2].ru_utime - before[2].ru_stime
    other_s = busy_cpu_s() - before[0] - (server.cpu_s() - before[1]) - client_s
    report = json.loads(path.read_text())
    share = other_s / (report["elapsed_s"] * (os.cpu_count() or 1))
    if share > 0.05:
        print(f"WARNING: other processes took {share:.0%} of the CPUs during this run: not a quiet host")
    keys = ("output_throughput", "elapsed_s", "num_requests", "num_failed", "prefix_hit_rate", "ttft_s")
    # token totals: the same on both servers when both tokenize alike and both honour ignore_eos
    totals = {t: sum(r[t] for r in report["requests"]) for t in ("prompt_tokens", "output_tokens")}
    return {k: report[k] for k in (*keys, "tpot_s", "e2e_s")} | totals | {"other_cpu_share": share}


def run_server(name: str, c: int, workloads: list[str], args, model_dir: Path, dtype: str, out: Path) -> dict:
    """Starts one server at --max-num-seqs C, runs every workload on it in order, stops it."""
    cmd, env = server_cmd(name, args, model_dir, dtype, c)
    server = Server(name, cmd, env, out / f"{name}_c{c}.log", args.port)
    print(f"\n== {name}, --max-num-seqs {c}: {' '.join(cmd)}", flush=True)
    try:
        ready_s = server.start(args.ready_timeout)
        print(f"{name} ready in {ready_s:.0f} s", flush=True)
        warm_up_text = server.warm_up()
        cells = {w: bench(server, w, args, out, c) for w in workloads}
    finally:
        server.stop()
    kv_log = server.log_lines("KV cache size", "Maximum concurrency")
    print(f"{name}: peak RSS {server.peak_rss / 2**30:.2f} GiB; {' | '.join(kv_log[:2])}", flush=True)
    peak_rss_gib = server.peak_rss / 2**30
    return {
        "ready_s": ready_s,
        "peak_rss_gib": peak_rss_gib,
        "kv_cache_log": kv_log,
        "warm_up_text": warm_up_text,
        "cmd": cmd,
        "cells": cells,
    }


def setup_vllm(venv: str) -> str | None:
    """None when vLLM is set up, else why not."""
    done = subprocess.run(["bash", str(HERE / "setup_vllm.sh"), venv], capture_output=True, text=True)
    return None if done.returncode == 0 else f"setup_vllm.sh failed:\n{(done.stdout + done.stderr)[-3000:]}"


def transformers_figures(workloads: list[str], args, model_dir: Path, dtype: str, out: Path) -> dict:
    """Output tokens/s of Hugging Face static batches of 8 (`pagedllm bench throughput`)."""
    figures = {}
    for w in workloads:
        path = out / f"transformers_{w}.json"
        cmd = [PAGEDLLM, "bench", "throughput", "--workload", f"{args.workloads}/{w}.jsonl"]
        cmd += ["--model", str(model_dir), "--dtype", dtype, "--decode-tokens", "0"]
        cmd += ["--output-json", str(path), *num_requests_args(args)]
        subprocess.run(cmd, check=True)
        figures[w] = json.loads(path.read_text())["naive"]["output_throughput"]
    return figures


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def ratio_table(results: dict) -> str:
    lines = [
        _row("workload", "in flight", "pagedllm tok/s", "vLLM tok/s", "ratio", "pagedllm TPOT p50 ms",
             "vLLM TPOT p50 ms"),
        _row(*["---"] * 7),
    ]  # fmt: skip
    for w in results["workloads"]:
        for c in results["concurrencies"]:
            ours = results["pagedllm"][str(c)]["cells"][w]
            theirs = results["vllm"][str(c)]["cells"][w]
            tok_s, their_tok_s = ours["output_throughput"], theirs["output_throughput"]
            lines.append(
                _row(w, c, f"{tok_s:.1f}", f"{their_tok_s:.1f}", f"{tok_s / their_tok_s:.2f}",
                     f"{ours['tpot_s']['p50'] * 1e3:.1f}", f"{theirs['tpot_s']['p50'] * 1e3:.1f}")
            )  # fmt: skip
    return "\n".join(lines)


def fallback_table(results: dict) -> str:
    here = results["transformers"]
    lines = [
        _row("workload", "in flight", "pagedllm tok/s", "transformers static 8, here",
             "transformers (README)", "vLLM (README)", "pagedllm TPOT p50 ms"),
        _row(*["---"] * 7),
    ]  # fmt: skip
    for w in results["workloads"]:
        for c in results["concurrencies"]:
            ours, readme = results["pagedllm"][str(c)]["cells"][w], README_FIGURES[w]
            lines.append(
                _row(w, c, f"{ours['output_throughput']:.1f}", f"{here[w]:.1f}",
                     readme["transformers static batch 8"], readme[f"vLLM {c}"],
                     f"{ours['tpot_s']['p50'] * 1e3:.1f}")
            )  # fmt: skip
    return "\n".join(lines)


def print_summary(results: dict, out: Path) -> None:
    host = results["host"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in host["flags"].items())
    print(f"\nCPU {host['cpu']} ({host['cores']} cores): {flags}")
    print(f"dtype {results['dtype']} ({results['dtype_reason']}); git {results['git']}; "
          f"wall {results['wall_s'] / 60:.1f} min")  # fmt: skip
    for name in ("vllm", "pagedllm"):
        for c, r in (results[name] or {}).items():
            rss, text = r["peak_rss_gib"], r["warm_up_text"]
            print(
                f"{name} --max-num-seqs {c}: ready in {r['ready_s']:.0f} s, peak RSS {rss:.2f} GiB; {text!r}"
            )
            busy = [w for w, cell in r["cells"].items() if cell["other_cpu_share"] > 0.05]
            if busy:
                print(f"  WARNING: other processes used the CPUs during {', '.join(busy)}: figures spoiled")
    if results["vllm_error"]:
        print(f"\nvLLM did not run here, so there is no same-host ratio. Why:\n{results['vllm_error']}\n")
        print("pagedllm beside transformers (here) and ../shared/peers/README.md (another host: rough only):")
        print(fallback_table(results))
    else:
        print("\nOutput tokens/s, ratio = pagedllm / vLLM:")
        print(ratio_table(results))
    print(f"\nall figures: {out / 'results.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="mixed at 8 in flight only (a smoke test)")
    parser.add_argument("--num-requests", type=int, help="first N requests of each workload (smoke tests)")
    workloads = ["mixed", "shared_prefix", "decode_heavy"]
    parser.add_argument("--workload", nargs="+", default=workloads, help="names in --workloads")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[8, 32], help="in flight, a start each")
    parser.add_argument("--vllm-venv", default=str(REPO.parent / "peers/vllm-venv"), help="made if missing")
    parser.add_argument("--workloads", default=str(REPO.parent / "shared/workloads"))
    parser.add_argument("--out", default=str(REPO / "results/vllm_compare"), help="logs, JSON, model folder")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: from the CPU flags")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ready-timeout", type=float, default=600, help="seconds a server may take to start")
    parser.add_argument("--skip-vllm", action="store_true", help="only the fallback comparison")
    parser.add_argument(
        "--reuse-vllm",
        metavar="RESULTS_JSON",
        help="take vLLM's figures from an earlier run's results.json on this host instead of running it "
        "again (for quick iterations; a published ratio comes from one run of both)",
    )
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    host = host_info()
    dtype, why = pick_dtype(host["flags"]) if args.dtype is None else (args.dtype, "given with --dtype")
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    results: dict = {
        "host": host,
        "dtype": dtype,
        "dtype_reason": why,
        "git": git.stdout.strip(),
        "model": MODEL_NAME,
        "workloads": ["mixed"] if args.quick else args.workload,
        "concurrencies": [8] if args.quick else args.concurrency,
    }
    print(
        f"CPU {host['cpu']}, {host['cores']} cores, flags {host['flags']}; dtype {dtype} ({why})", flush=True
    )
    before = busy_cpu_s()
    time.sleep(3)
    if (busy := (busy_cpu_s() - before) / (3 * (os.cpu_count() or 1))) > 0.1:
        print(f"WARNING: the CPUs are {busy:.0%} busy before any server starts: figures will suffer")
    model_dir = write_hf_model(out / f"model-{dtype}", dtype)
    print(f"model folder: {model_dir}", flush=True)

    reused = json.loads(Path(args.reuse_vllm).read_text()) if args.reuse_vllm else None
    if reused is not None:
        vllm_error = None
        results["vllm_reused_from"] = f"{args.reuse_vllm} (git {reused['git']})"
        print(f"vLLM figures reused from {results['vllm_reused_from']}: not a same-run ratio", flush=True)
    else:
        vllm_error = "skipped (--skip-vllm)" if args.skip_vllm else setup_vllm(args.vllm_venv)
    results["pagedllm"], results["vllm"] = {}, None if vllm_error else {}
    for c in results["concurrencies"]:
        if reused is not None:
            results["vllm"][str(c)] = reused["vllm"][str(c)]
        elif not vllm_error:
            try:
                results["vllm"][str(c)] = run_server(
                    "vllm", c, results["workloads"], args, model_dir, dtype, out
                )
            except (RuntimeError, subprocess.CalledProcessError, httpx.HTTPError) as error:
                vllm_error, results["vllm"] = f"vLLM failed on this host: {error}", None
                print(vllm_error, flush=True)
        results["pagedllm"][str(c)] = run_server(
            "pagedllm", c, results["workloads"], args, model_dir, dtype, out
        )
    results["vllm_error"] = vllm_error
    if vllm_error:
        results["transformers"] = transformers_figures(results["workloads"], args, model_dir, dtype, out)
    results["wall_s"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_summary(results, out)


if __name__ == "__main__":
    main()
