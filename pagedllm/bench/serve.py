"""`pagedllm bench serve`: load any OpenAI-compatible server, ours or vLLM's, with streamed requests.

Requests come from a dataset (datasets.py: `random`, ShareGPT JSON, or our JSONL workloads), with
`vllm bench serve`'s flags. Single-turn requests go to /v1/completions; conversations go to
/v1/chat/completions turn by turn, each answer in the next turn's history. Requests are greedy.
They are sent all at once (--request-rate inf) or as Poisson / gamma arrivals (arrivals.py), and
--max-concurrency caps how many are in flight either way. Only the OpenAI API is used (streaming,
usage in the last chunk via stream_options.include_usage), so vLLM's server needs no change.

A progress bar runs meanwhile; then a table of throughput, goodput and latencies (serve_metrics.py)
is printed, and --output-json / --save-result write it with vLLM's JSON keys beside ours
(serve_report.py). --seed
(an engine flag, default 0) also seeds the dataset and the arrivals. With --offline the same
requests then run through the offline engine in this process, as a closed loop at the same
concurrency, for a server/offline throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
from tqdm import tqdm

from pagedllm.bench.arrivals import arrival_times
from pagedllm.bench.datasets import add_dataset_arguments, dataset_name, dataset_source, load_dataset_for
from pagedllm.bench.prefix import Client, make_clients, run_closed_loop
from pagedllm.bench.serve_metrics import METRICS, SLO_METRICS, RequestRecord, ServeResult
from pagedllm.bench.serve_report import build_report, result_path, save_plot
from pagedllm.bench.throughput import git_sha
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.logger import configure_logging
from pagedllm.sampling_params import SamplingParams
from pagedllm.workload import BenchRequest, Conversation

Items = list[BenchRequest] | list[Conversation]
Done = Callable[[RequestRecord], None]
Send = Callable[[httpx.AsyncClient, float, Done], Awaitable[None]]
"""Sends one dataset item's requests (a conversation's turns in order) on a client, given the run's
start (perf_counter), and hands each record to `Done` as its request ends."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root, without /v1 (default: --host, --port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_dataset_arguments(parser)
    parser.add_argument(
        "--max-concurrency", "--concurrency", type=int, default=None, help="most requests in flight at once"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="arrivals per second (default: inf, every request at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 is Poisson, <1 burstier, >1 more even",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the `model` field to send (default: the server's first)"
    )
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=None,
        metavar="METRIC:MS",
        help="service level objectives (ttft, tpot, e2el in ms): goodput counts the requests meeting all",
    )
    parser.add_argument(
        "--percentile-metrics",
        type=_metric_list,
        default=list(METRICS),
        help=f"comma-separated, of {','.join(METRICS)} (default: all)",
    )
    parser.add_argument(
        "--metric-percentiles", type=_percentile_list, default=[99.0], help="comma-separated (default: 99)"
    )
    parser.add_argument("--output-json", default=None, help="write the summary and every request here")
    parser.add_argument("--save-result", action="store_true", help="also write it to a file named as vLLM's")
    parser.add_argument("--result-dir", default=None, help="folder of --save-result's file")
    parser.add_argument("--result-filename", default=None, help="name of --save-result's file")
    parser.add_argument(
        "--save-detailed", action="store_true", help="add vLLM's per-request lists (ttfts, itls, ...)"
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--plot", default=None, help="write a PNG of the TTFT, TPOT and E2E distributions")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="then run the offline engine (engine flags below: pass the server's) on the same requests "
        "at the same concurrency, and print server/offline throughput",
    )
    add_engine_args(parser)


def _slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = math.nan
    if name not in SLO_METRICS or not limit >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give METRIC:MS, METRIC one of {', '.join(SLO_METRICS)}")
    return name, limit


def _metric_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in METRICS for name in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated names of {', '.join(METRICS)}")
    return names


def _percentile_list(text: str) -> list[float]:
    try:
        values = [float(q) for q in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < q <= 100 for q in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated percentiles in (0, 100]")
    return values


# ---- the HTTP side ---------------------------------------------------------------------------


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict, origin: float, prompt_len: int | None = None
) -> tuple[RequestRecord, str]:
    """One streamed request; returns its record and the generated text."""
    start = time.perf_counter()
    record, text, last_chunk = RequestRecord(prompt_tokens=prompt_len or 0, start_s=start - origin), "", None
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
                    # a completion chunk is a token even with empty text (part of a character), as
                    # vLLM counts it; a chat chunk only with content (the first may carry just the role)
                    if "text" in choice or piece or choice.get("finish_reason"):
                        now = time.perf_counter()
                        if last_chunk is None:
                            record.ttft_s = now - start
                        else:
                            record.itl_s.append(now - last_chunk)
                        last_chunk = now
                    text += piece
                    record.output_tokens += bool(piece)  # replaced by usage when the server sends it
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens")
                if (timings := chunk.get("timings")) and "draft_n" in timings:  # the choice's last chunk
                    record.draft_tokens = timings["draft_n"]
                    record.accepted_draft_tokens = timings.get("draft_n_accepted")
        if record.ttft_s is None:
            raise RuntimeError("the stream ended before any token")
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as error:
        record.error = str(error) or type(error).__name__
    record.e2e_s = time.perf_counter() - start
    return record, text


def _senders(items: Items, model: str) -> Iterator[Send]:
    for item in items:
        if isinstance(item, Conversation):

            async def send_turns(
                client: httpx.AsyncClient, origin: float, done: Done, c: Conversation = item
            ) -> None:
                messages = [{"role": "system", "content": c.system}] if c.system else []
                for turn in c.turns:
                    messages.append({"role": "user", "content": turn})
                    body = {"model": model, "messages": messages, "max_tokens": c.max_tokens}
                    if c.ignore_eos:  # only when asked: servers that lack the field get no new key
                        body["ignore_eos"] = True
                    record, answer = await _stream(client, "/v1/chat/completions", body, origin)
                    done(record)
                    if record.error:
                        break
                    messages.append({"role": "assistant", "content": answer})

            yield send_turns
        else:
            body = {
                "model": model,
                "prompt": item.prompt,
                "max_tokens": item.max_tokens,
                "ignore_eos": item.ignore_eos,
            }

            async def send_prompt(
                client: httpx.AsyncClient, origin: float, done: Done, b: dict = body, r: BenchRequest = item
            ) -> None:
                done((await _stream(client, "/v1/completions", b, origin, r.prompt_len))[0])

            yield send_prompt


async def run_server_benchmark(
    args: argparse.Namespace, items: Items, send_times: list[float]
) -> tuple[ServeResult, str]:
    """Sends every item at its time (seconds after the start), at most --max-concurrency at once."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    in_flight = args.max_concurrency or max(len(items), 1)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(
        base_url=base_url(args), headers=headers, timeout=None, limits=limits
    ) as client:
        model = args.served_model_name
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        num_requests = sum(len(i.turns) if isinstance(i, Conversation) else 1 for i in items)
        print(_header(args, model, num_requests), flush=True)
        seats = asyncio.Semaphore(in_flight)
        result = ServeResult()
        bar = tqdm(total=num_requests, unit="req", disable=args.disable_tqdm)

        def done(record: RequestRecord) -> None:
            result.records.append(record)
            bar.update()

        async def one(send: Send, at: float) -> None:
            await asyncio.sleep(max(0.0, origin + at - time.perf_counter()))
            async with seats:
                await send(client, origin, done)

        origin = time.perf_counter()
        await asyncio.gather(
            *(one(send, at) for send, at in zip(_senders(items, model), send_times, strict=True))
        )
        result.elapsed_s = time.perf_counter() - origin
        bar.close()
    return result, model


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _header(args: argparse.Namespace, model: str, num_requests: int) -> str:
    rate = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    if not math.isinf(args.request_rate) and args.burstiness != 1.0:
        rate += f" (burstiness {args.burstiness:g})"
    return (
        f"{num_requests} requests from {dataset_source(args)} to {base_url(args)} ({model}), {rate}, "
        f"at most {args.max_concurrency or 'all'} in flight; git {git_sha()}"
    )


# ---- offline, main ----------------------------------------------------------------------------


def _offline_client(request: BenchRequest) -> Client:
    params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=request.ignore_eos)
    yield {"prompt": request.prompt}, params


def offline_throughput(args: argparse.Namespace, items: Items) -> float:
    """Output tokens/s of the offline engine on the same requests, a closed loop at the same concurrency."""
    engine = LLMEngine(engine_config_from_args(args, disable_log_stats=True))
    if items and isinstance(items[0], Conversation):
        clients = make_clients(args.dataset_path, engine.tokenizer, args.num_prompts)
    else:
        clients = [_offline_client(r) for r in items]  # type: ignore[arg-type]
    return run_closed_loop(engine, clients, args.max_concurrency or len(clients)).output_throughput


def main(args: argparse.Namespace) -> None:
    configure_logging()
    try:
        config = engine_config_from_args(args)  # --model, --tokenizer and --seed are engine flags
        items, tokenizer_folder = load_dataset_for(args, config)
        tokenizer_id = str(tokenizer_folder) if tokenizer_folder else None
        send_times = arrival_times(len(items), args.request_rate, args.burstiness, config.seed)
    except (ValueError, OSError) as error:
        raise SystemExit(f"pagedllm bench serve: {error}") from None
    result, model = asyncio.run(run_server_benchmark(args, items, send_times))
    offline = offline_throughput(args, items) if args.offline else None
    text, report = build_report(args, base_url(args), model, tokenizer_id, len(items), result, offline)
    print(text)
    paths = [Path(args.output_json)] if args.output_json else []
    paths += [result_path(args, report)] if args.save_result else []
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    if args.plot:
        source = Path(args.dataset_path).name if args.dataset_path else dataset_name(args)
        save_plot(result, args.plot, f"{model} via {base_url(args)}: {source}")
