"""`pagedllm bench soak`: hours of traffic in minutes, the kind that breaks servers.

--concurrency clients send, until --minutes have passed, a mix of
- good requests from a workload (streamed or not, greedy), whose latency is tracked;
- aborts: a stream the client closes after a few chunks (the server must free its blocks);
- disconnects: a non-streamed request whose client gives up before the answer;
- bad requests: each a kind that once stopped or stalled a server (invalid Unicode, ids past the
  vocabulary, huge integers, client templates, bodies too deep or too large, grammars too deep
  to compile, malformed tool calls ...), which must get a 4xx and harm no one;
- structured: a chat request constrained to a small JSON schema (a grammar compiled and applied);
- tools: a chat request with a tool it must call (`tool_choice: required`).
Then it waits for the server to go idle and reports: requests served, outcomes by kind, errors by
class (anything but a 4xx for a bad request, or a 5xx at all, is an error), the server's resident
memory at start / peak / end, KV blocks still held (leaked; must be 0), and how the median
time per output token of good requests drifted from the first tenth of the run to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pagedllm.bench.server_process import ServerProcess
from pagedllm.bench.throughput import git_sha
from pagedllm.logger import configure_logging
from pagedllm.workload import load_requests

API_KEY = "soak"
KINDS = ("good", "abort", "disconnect", "bad", "structured", "tools")
_LONG = "Hello " * 40
_CHAT = '{"messages": [{"role": "user", "content": "hi"}], '
_TOOLS = (
    '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'
)
# 450 nested objects as a schema string: once kept the grammar compiler busy for 25-45 s
_NESTED_SCHEMA = '{"type": "object", "properties": {"a": ' * 450 + '{"type": "string"}' + "}}" * 450
# the same depth, flat: 450 $defs each referring to the next (held a compile worker 10 s)
_REF_CHAIN_SCHEMA = {
    "$defs": {
        **{
            f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(449)
        },
        "d449": {"type": "string"},
    },
    "$ref": "#/$defs/d0",
}
# templates that allocate gigabytes in one call (run only where the server trusts client
# templates, --trust-request-chat-template; elsewhere refused before rendering, also a 400)
_TEMPLATE_BOMBS = (
    "{{ '%2000000000s'|format('x') }}",
    "{{ 'x'|center(5000000000) }}",
    "{{ lipsum(n=100000000) }}",
)
_REF_CHAIN_JSON = json.dumps(_REF_CHAIN_SCHEMA)
_TEMPLATE_BOMB_JSON = [json.dumps(bomb) for bomb in _TEMPLATE_BOMBS]
BAD_REQUESTS: list[tuple[str, str | bytes]] = [
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1000000]}'),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 4, "seed": 18446744073709551616}'),
    ("/v1/completions", '{"prompt": "Hello", "top_k": 1000000000000000000000000000000, "top_p": 0.9}'),
    ("/v1/completions", '{"prompt": "' + _LONG + '", "max_tokens": 4, "cache_salt": "\\ud800"}'),
    ("/v1/completions", '{"prompt": "Hello there", "max_tokens": 2, "user": "\\ud800"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udc00"}]}'),
    ("/v1/chat/completions", _CHAT + '"chat_template": "{{ 1/0 }}"}'),
    ("/v1/chat/completions", _CHAT + '"chat_template_kwargs": {"tokenize": true}}'),
    ("/v1/completions", '{"prompt": ' + "[" * 600 + "1" + "]" * 600 + "}"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("/v1/completions", '{"prompt": "Hello", "n": 1000000}'),
    ("/v1/completions", '{"prompt": "Hello", "user": "' + "u" * 5000 + '"}'),
    ("/v1/completions", '{"prompt": [1, 2, 49152]}'),
    ("/tokenize", '{"prompt": "Hello \\ud800"}'),
    ("/v1/chat/completions", _CHAT + '"structured_outputs": {"json": ' + json.dumps(_NESTED_SCHEMA) + "}}"),
    ("/v1/chat/completions", _CHAT + '"structured_outputs": {"json": "' + "[" * 30000 + '"}}'),
    ("/v1/chat/completions", _CHAT + '"structured_outputs": {"json": {"$ref": "https://a.example/s.json"}}}'),
    ("/v1/chat/completions", _CHAT + '"structured_outputs": {"json": ' + _REF_CHAIN_JSON + "}}"),
    *(("/v1/chat/completions", _CHAT + '"chat_template": ' + bomb + "}") for bomb in _TEMPLATE_BOMB_JSON),
    ("/v1/chat/completions", _CHAT + '"tools": ' + _TOOLS + ', "tool_choice": '
     '{"type": "function", "function": "f"}}'),
    ("/v1/chat/completions", '{"messages": [{"role": "assistant", "tool_calls": 7}, '
     '{"role": "user", "content": "hi"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "assistant", "tool_calls": [{"id": "a", '
     '"type": "function", "function": "f"}]}, {"role": "user", "content": "hi"}]}'),
]  # fmt: skip
STRUCTURED_BODY = {
    "messages": [{"role": "user", "content": "Describe a person as JSON."}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "person",
            "schema": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        },
    },
    "max_tokens": 48,
    "temperature": 0,
}
TOOLS_BODY = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": json.loads(_TOOLS),
    "tool_choice": "required",
    "max_tokens": 48,
    "temperature": 0,
}


@dataclass
class Outcome:
    kind: str
    start_s: float
    """Seconds since the run began."""
    status: str
    """ok | expected_4xx, or the error class: unexpected_4xx, 5xx, error_event, connection, ..."""
    output_tokens: int = 0
    e2e_s: float = 0.0


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_samples: list[tuple[float, int]] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="single-turn JSONL (prompt, max_tokens)")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--mix",
        default="0.5,0.15,0.1,0.15,0.05,0.05",
        help="fractions of good, abort, disconnect, bad, structured and tools requests "
        "(default: 0.5,0.15,0.1,0.15,0.05,0.05; the last two may be left out: 0)",
    )
    parser.add_argument("--max-tokens-cap", type=int, default=64, help="cap on a good request's max_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-args",
        default="--max-num-seqs 16",
        help="flags of the pagedllm server this benchmark starts (default: --max-num-seqs 16)",
    )
    parser.add_argument("--server-log", default=None, help="write the server's log here")
    parser.add_argument("--output-json", default=None)


async def _send(
    client: httpx.AsyncClient, kind: str, rng: random.Random, requests: list, cap: int
) -> Outcome:
    outcome = Outcome(kind, 0.0, "ok")
    start = time.perf_counter()
    try:
        if kind == "bad":
            bad_path, bad_body = rng.choice(BAD_REQUESTS)
            response = await client.post(
                bad_path, content=bad_body, headers={"Content-Type": "application/json"}
            )
            outcome.status = _bad_status(response)
        elif kind in ("structured", "tools"):
            response = await client.post("/v1/chat/completions", json=_chat_body(kind))
            outcome.status, outcome.output_tokens = _chat_status(kind, response)
        else:
            item = rng.choice(requests)
            body = {"prompt": item.prompt, "max_tokens": min(item.max_tokens, cap), "temperature": 0}
            body["ignore_eos"] = True
            if kind == "disconnect":
                await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 1.0))
            else:
                outcome.status, outcome.output_tokens = await _stream(
                    client, body, stop_after=rng.randint(1, 4) if kind == "abort" else None
                )
    except httpx.TimeoutException:
        outcome.status = "ok" if kind == "disconnect" else "timeout"  # giving up is the point
    except httpx.HTTPError as error:
        outcome.status = f"connection:{type(error).__name__}"
    outcome.e2e_s = time.perf_counter() - start
    return outcome


def _chat_body(kind: str) -> dict:
    return STRUCTURED_BODY if kind == "structured" else TOOLS_BODY


def _chat_status(kind: str, response: httpx.Response) -> tuple[str, int]:
    """A constrained answer must be a 200 that honours its constraint: JSON that parses (unless
    cut by max_tokens) for a schema, a call of the tool for `tool_choice: required`."""
    if response.status_code != 200:
        return ("5xx" if response.status_code >= 500 else "unexpected_4xx"), 0
    body = response.json()
    choice = body["choices"][0]
    tokens = body["usage"]["completion_tokens"]
    if kind == "tools":
        calls = choice["message"].get("tool_calls") or []
        return (
            "ok" if calls and calls[0]["function"]["name"] == "get_weather" else "tool_not_called"
        ), tokens
    if choice["finish_reason"] == "length":
        return "ok", tokens
    try:
        json.loads(choice["message"]["content"])
    except (TypeError, ValueError):
        return "schema_not_followed", tokens
    return "ok", tokens


def _bad_status(response: httpx.Response) -> str:
    if response.status_code >= 500:
        return "5xx"
    if not 400 <= response.status_code < 500:
        return f"bad_request_got_{response.status_code}"
    body = response.json()
    is_openai_shape = set(body) == {"error"} and {"message", "type", "param", "code"} == set(body["error"])
    return "expected_4xx" if is_openai_shape else "non_openai_error_body"


async def _stream(client: httpx.AsyncClient, body: dict, stop_after: int | None) -> tuple[str, int]:
    """(status, chunks received); closing the stream early (stop_after) aborts the request."""
    chunks = 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return ("5xx" if response.status_code >= 500 else "unexpected_4xx"), 0
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"error"' in line[:20]:
                return "error_event", chunks
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return "ok", chunks
    return "ok", chunks


async def run_soak(args: argparse.Namespace, server: ServerProcess) -> Soak:
    requests = load_requests(args.workload)
    weights = [float(x) for x in args.mix.split(",")]
    weights += [0.0] * (len(KINDS) - len(weights))
    soak = Soak()
    deadline = time.perf_counter() + args.minutes * 60
    begin = time.perf_counter()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert server.url is not None  # ServerProcess returns once the server has said where it listens
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=600) as client:

        async def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.perf_counter() < deadline:
                kind = rng.choices(KINDS, weights)[0]
                at = time.perf_counter() - begin
                outcome = await _send(client, kind, rng, requests, args.max_tokens_cap)
                outcome.start_s = at
                soak.outcomes.append(outcome)

        async def sample_memory() -> None:
            while time.perf_counter() < deadline:
                soak.rss_samples.append((time.perf_counter() - begin, server.rss_bytes()))
                await asyncio.sleep(5)

        await asyncio.gather(sample_memory(), *(worker(i) for i in range(args.concurrency)))
    return soak


def _idle_stats(url: str, timeout_s: float = 120.0) -> dict:
    """/stats once nothing runs or waits (aborts and disconnects have been processed)."""
    end = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > end:
            return stats
        time.sleep(0.5)


def _tpot_p50(outcomes: list[Outcome]) -> float | None:
    values = [o.e2e_s / o.output_tokens for o in outcomes if o.output_tokens > 1]
    return float(np.median(values)) if values else None


def _cached_tokens_by_source(url: str) -> dict[str, float]:
    """Prefix-cache hit tokens by the tier that held them (device, disk), from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(
        r'^\w+:prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', text, re.M
    )
    return {source: float(value) for source, value in found}


def report(
    args: argparse.Namespace,
    soak: Soak,
    stats: dict,
    health: int,
    final_rss: int,
    cached: dict[str, float],
    git: str,
) -> dict:
    duration = args.minutes * 60
    good = [o for o in soak.outcomes if o.kind == "good" and o.status == "ok"]
    first = _tpot_p50([o for o in good if o.start_s < duration / 10])
    last = _tpot_p50([o for o in good if o.start_s >= duration * 9 / 10])
    errors = Counter(o.status for o in soak.outcomes if o.status not in ("ok", "expected_4xx"))
    rss = [r for _, r in soak.rss_samples]
    kv_cache = stats["kv_cache"]
    leaked = kv_cache["num_blocks"] - kv_cache["free_blocks"]
    result = {
        "git": git,
        "workload": args.workload,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "server_args": args.server_args,
        "requests": len(soak.outcomes),
        "by_kind": {k: Counter(o.status for o in soak.outcomes if o.kind == k) for k in KINDS},
        "errors": dict(errors),
        "rss_mib": {
            "start": rss[0] / 2**20 if rss else None,
            "quarters": [rss[len(rss) * q // 4] / 2**20 for q in (1, 2, 3)] if rss else None,
            "peak": max(rss) / 2**20 if rss else None,
            "end": final_rss / 2**20,
        },
        "rss_samples_mib": [(round(t, 1), r / 2**20) for t, r in soak.rss_samples],
        "blocks_leaked": leaked,
        "health_after": health,
        "good_tpot_p50_ms": {
            "first_tenth": first * 1e3 if first else None,
            "last_tenth": last * 1e3 if last else None,
            "drift": last / first - 1 if first and last else None,
        },
        "generation_tokens": stats["generation_tokens"],
        "prompt_tokens_cached_by_source": cached,
    }
    by_kind = ", ".join(f"{k} {sum(c.values())}" for k, c in result["by_kind"].items())
    drift = result["good_tpot_p50_ms"]
    lines = [
        f"soak: {args.minutes:g} min at concurrency {args.concurrency}, {args.workload}, git {result['git']}",
        f"requests: {len(soak.outcomes)} ({by_kind}); good ones served: {len(good)}",
        f"errors: {dict(errors) or 'none'}",
        "server RSS MiB: start {start:.0f}, at 1/4 2/4 3/4 {q[0]:.0f} {q[1]:.0f} {q[2]:.0f}, "
        "peak {peak:.0f}, end {end:.0f}".format(q=result["rss_mib"]["quarters"], **result["rss_mib"])
        if rss
        else "server RSS: not sampled",
        f"KV blocks leaked: {leaked} of {kv_cache['num_blocks']}; /health after: {health}",
        "prefix-cache hit tokens by tier: "
        + (", ".join(f"{source} {value:,.0f}" for source, value in cached.items()) or "n/a"),
        f"good requests' time per token p50: first tenth {_ms(drift['first_tenth'])}, "
        f"last tenth {_ms(drift['last_tenth'])} (drift {_pct(drift['drift'])})",
    ]
    result["text"] = "\n".join(lines)
    return result


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def main(args: argparse.Namespace) -> None:
    configure_logging()
    server_args = [*args.server_args.split(), "--api-key", API_KEY, "--disable-log-stats"]
    git = git_sha()  # the commit the server starts from, not whatever is checked out at the end
    server = ServerProcess(server_args, log_path=args.server_log)
    try:
        soak = asyncio.run(run_soak(args, server))
        assert server.url is not None
        stats = _idle_stats(server.url)
        health = httpx.get(f"{server.url}/health").status_code
        cached = _cached_tokens_by_source(server.url)
        result = report(args, soak, stats, health, server.rss_bytes(), cached, git)
    finally:
        server.stop()
    print(result.pop("text"))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
