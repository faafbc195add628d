"""`pagedllm bench serve`: drive any OpenAI-compatible server with streaming requests.

Single-turn workloads go to /v1/completions, one request per line; conversation workloads go
to /v1/chat/completions turn by turn, each answer in the next turn's history. Requests are greedy
with the workload's max_tokens (and ignore_eos), as the offline benchmarks send them. Traffic is
a closed loop of --concurrency clients, or Poisson arrivals at --request-rate (optionally capped
by --concurrency). With --offline the same workload then runs through the offline engine in
this process, as the same closed loop, for a server/offline throughput ratio.

    TTFT = first text chunk - send;  TPOT = (E2E - TTFT) / (output tokens - 1)
    prefix hit rate = sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pagedllm.bench.prefix import make_clients, run_closed_loop
from pagedllm.bench.throughput import git_sha
from pagedllm.bench.workload import Conversation, load_workload
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.logger import configure_logging

QUANTILES = (50, 95, 99)
HTTPClient = Callable[[httpx.AsyncClient], Awaitable[list["RequestRecord"]]]
"""Sends one workload line's requests (a conversation's turns in order); returns their records."""


@dataclass
class RequestRecord:
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str | None = None

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

    def quantiles(self, name: str) -> dict[str, float] | None:
        values = [v for r in self.ok if (v := getattr(r, name)) is not None]
        if not values:
            return None
        return {f"p{q}": float(np.percentile(values, q)) for q in QUANTILES} | {
            "mean": float(np.mean(values))
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    parser.add_argument(
        "--workload", required=True, help="JSONL: single-turn (prompt, max_tokens) or conversations"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="first N lines only")
    parser.add_argument(
        "--concurrency", type=int, default=None, help="clients in flight at once (default: all at once)"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: inf, i.e. a closed loop at --concurrency)",
    )
    parser.add_argument("--arrival-seed", type=int, default=0, help="seed of the Poisson arrival times")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` field to send (default: the server's first model)",
    )
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--output-json", default=None, help="write the summary and every request here")
    parser.add_argument(
        "--plot", default=None, help="write a PNG of the TTFT, TPOT and E2E distributions here"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="then run the offline engine (engine flags below: pass the server's) on the same workload "
        "at the same concurrency, and print server/offline throughput",
    )
    add_engine_args(parser)


# ---- the HTTP side ---------------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple[RequestRecord, str]:
    """One streamed request; returns its record and the generated text."""
    record, text, start = RequestRecord(), "", time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error event"))
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece and record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    text += piece
                    record.output_tokens += bool(piece)  # replaced by usage when the server sends it
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens", 0)
                    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens")
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as error:
        record.error = str(error) or type(error).__name__
    record.e2e_s = time.perf_counter() - start
    return record, text


def _clients(path: str, limit: int | None, model: str) -> Iterator[HTTPClient]:
    """One client per workload line: a conversation's turns run one after the other."""
    for item in load_workload(path, limit):
        if isinstance(item, Conversation):

            async def run(client: httpx.AsyncClient, c: Conversation = item) -> list[RequestRecord]:
                messages = [{"role": "system", "content": c.system}] if c.system else []
                records = []
                for turn in c.turns:
                    messages.append({"role": "user", "content": turn})
                    body = {"model": model, "messages": messages, "max_tokens": c.max_tokens}
                    record, answer = await _stream(client, "/v1/chat/completions", body)
                    records.append(record)
                    if record.error:
                        break
                    messages.append({"role": "assistant", "content": answer})
                return records

        else:
            body = {
                "model": model,
                "prompt": item.prompt,
                "max_tokens": item.max_tokens,
                "ignore_eos": item.ignore_eos,
            }

            async def run(client: httpx.AsyncClient, b: dict = body) -> list[RequestRecord]:
                return [(await _stream(client, "/v1/completions", b))[0]]

        yield run


async def run_server_benchmark(args: argparse.Namespace) -> tuple[ServeResult, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=args.concurrency or 1000, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        model = args.served_model_name
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        clients = list(_clients(args.workload, args.num_requests, model))
        seats = asyncio.Semaphore(args.concurrency or len(clients))
        arrivals = random.Random(args.arrival_seed)
        result = ServeResult()

        async def one(run: HTTPClient) -> None:
            async with seats:
                result.records.extend(await run(client))

        start = time.perf_counter()
        tasks = []
        for run in clients:
            tasks.append(asyncio.create_task(one(run)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        result.elapsed_s = time.perf_counter() - start
    return result, model


# ---- report ----------------------------------------------------------------------------------


def _report(args: argparse.Namespace, model: str, result: ServeResult, offline: float | None) -> dict:
    failed = len(result.records) - len(result.ok)
    traffic = f"concurrency {args.concurrency or 'unbounded'}" + (
        f", {args.request_rate:g} req/s" if args.request_rate != float("inf") else ""
    )
    lines = [
        f"server {args.base_url} ({model}), workload {args.workload}: {len(result.records)} requests, "
        f"{traffic}, git {git_sha()}",
        f"{'':<12}{'p50':>10}{'p95':>10}{'p99':>10}{'mean':>10}",
    ]
    for label, name, scale in (
        ("TTFT ms", "ttft_s", 1e3),
        ("TPOT ms", "tpot_s", 1e3),
        ("E2E s", "e2e_s", 1.0),
    ):
        q = result.quantiles(name)
        values = [q[k] * scale for k in ("p50", "p95", "p99", "mean")] if q else []
        lines.append(f"{label:<12}" + "".join(f"{v:>10.1f}" for v in values))
    hit_rate = result.prefix_hit_rate
    lines += [
        f"output tokens/s: {result.output_throughput:.1f} over {result.elapsed_s:.1f} s; "
        f"prefix hit rate: {'n/a' if hit_rate is None else f'{hit_rate:.1%}'}; failed: {failed}",
    ]
    if failed:
        lines.append(f"first error: {next(r.error for r in result.records if r.error)}")
    if offline is not None:
        lines.append(
            f"offline engine, same workload and concurrency: {offline:.1f} tokens/s; "
            f"server/offline: {result.output_throughput / offline:.2f}x"
        )
    return {
        "text": "\n".join(lines),
        "base_url": args.base_url,
        "model": model,
        "workload": args.workload,
        "concurrency": args.concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "git": git_sha(),
        "num_requests": len(result.records),
        "num_failed": failed,
        "elapsed_s": result.elapsed_s,
        "output_throughput": result.output_throughput,
        "prefix_hit_rate": hit_rate,
        "ttft_s": result.quantiles("ttft_s"),
        "tpot_s": result.quantiles("tpot_s"),
        "e2e_s": result.quantiles("e2e_s"),
        "offline_output_throughput": offline,
        "server_offline_ratio": result.output_throughput / offline if offline else None,
        "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in result.records],
    }


def save_plot(result: ServeResult, path: str, title: str) -> None:
    import matplotlib  # here, not at the top: only this command needs it, and it is slow to import

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


def main(args: argparse.Namespace) -> None:
    configure_logging()
    result, model = asyncio.run(run_server_benchmark(args))
    offline = None
    if args.offline:
        engine = LLMEngine(engine_config_from_args(args, disable_log_stats=True))
        clients = make_clients(args.workload, engine.tokenizer, args.num_requests)
        offline = run_closed_loop(engine, clients, args.concurrency or len(clients)).output_throughput
    report = _report(args, model, result, offline)
    print(report.pop("text"))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    if args.plot:
        save_plot(result, args.plot, f"{model} via {args.base_url}: {Path(args.workload).name}")
