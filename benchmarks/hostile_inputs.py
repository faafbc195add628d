"""Hostile inputs (issue 45): what a runaway chat template, a client's slow grammars and a damaged
model file cost everyone else, each against a baseline measured in the same run.

    .venv/bin/python benchmarks/hostile_inputs.py [--served | --served-only] [--output-json FILE]

1. Templates. A bystander's encode, and its chat_prompt with the model's own template, through
   the server's AsyncTokenizer: alone, then while another task's template loops until its time
   budget. Then every bomb of tests/test_template_bombs.py through chat_prompt with the server's
   budget and the bound of --max-model-len: time to the refusal, RSS growth.
2. Grammars. A victim client's trivial regex through the server's GrammarCompilePool (real
   compile processes, the default model's vocabulary): alone, then while another client holds two
   slow (legal) compiles. The 42 KB $ref chain's time to its refusal, beside a short chain
   accepted by the same check.
3. Model files. Every case of tests/hostile_files.py through what `plan` and `serve` read: time
   to the one-line ModelLoadError beside reading the undamaged base files, and the process's RSS.
   Three cases through `python -m pagedllm generate` in a child, beside `plan` on the
   undamaged base file (the same imports, and a file read to the end).
4. Served (--served). A server of its own that trusts client templates: a bystander's streamed
   completion (200 tokens, greedy, ignore_eos) alone, then streamed again and again while another
   client sends every bomb as a /v1/chat/completions request, one after another: the bystander's
   gaps between chunks, each bomb's status and latency, the server's RSS (polled every 50 ms).
   Then a bystander's /tokenize alone and while a template loops to the server's budget.

Run first, so that the process's peak RSS is its imports and the corpus: the model files.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pagedllm import limits  # noqa: E402
from pagedllm.bench.server_process import ServerProcess  # noqa: E402
from pagedllm.bench.throughput import git_sha  # noqa: E402
from pagedllm.cpu_features import describe_host  # noqa: E402
from pagedllm.engine.async_tokenizer import AsyncTokenizer  # noqa: E402
from pagedllm.model.config_reader import model_config_from_folder  # noqa: E402
from pagedllm.model.errors import ModelLoadError  # noqa: E402
from pagedllm.model.locate import resolve_model_folder  # noqa: E402
from pagedllm.planner import read_model_config  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import StructuredOutputBackend  # noqa: E402
from pagedllm.structured_output.compile_pool import GrammarCompilePool  # noqa: E402
from pagedllm.tokenizer import chat_prompt, load_tokenizer, max_prompt_chars, max_token_chars  # noqa: E402
from tests.hostile_files import all_cases, base_spec, build_gguf, write_hf  # noqa: E402
from tests.schema_bombs import ref_chain_schema_text  # noqa: E402
from tests.test_template_bombs import BOMBS, LOOPS, PeakRss  # noqa: E402

CHAT = [{"role": "user", "content": "hi"}]
SHORT_TEXT = "Hello there"
NUM_SAMPLES = 100
"""Bystander rounds alone (during the runaway: as many as it lasts)."""
NUM_VICTIMS = 5
"""Victim regexes alone, and again while the slow compiles are held."""
CLI_CASES = ["gguf-block-count-2e8", "hf-torch-dtype-float1024", "gguf-two-tensors-one-offset"]


def slow_schema(tag: str, num_properties: int = 150) -> str:
    """Legal, flat and slow: an object of `num_properties` object-valued properties (its
    compiled grammar is large, and slow to build and serialize for a 49k vocabulary)."""
    inner = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"],
    }
    names = [f"{tag}{i}" for i in range(num_properties)]
    return json.dumps({"type": "object", "properties": dict.fromkeys(names, inner), "required": names})


def summary_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1e3 for s in seconds]
    return {"n": len(ms), "median_ms": statistics.median(ms) if ms else None, "max_ms": max(ms, default=None)}


# ---- 1. templates ---------------------------------------------------------------------------------


async def _sample(
    works: Mapping[str, Callable[[], Awaitable[Any]]], count: int, until: asyncio.Future[Any] | None
) -> dict[str, list[float]]:
    """Seconds each call took, `count` rounds of every work in turn, 10 ms apart; with `until`,
    only calls that ended before it did (the samples taken while it ran)."""
    seconds: dict[str, list[float]] = {name: [] for name in works}
    for _ in range(count):
        for name, work in works.items():
            start = time.perf_counter()
            await work()
            if until is not None and until.done():
                return seconds
            seconds[name].append(time.perf_counter() - start)
            await asyncio.sleep(0.01)
    return seconds


async def bystanders(tokenizer: Any, max_model_len: int, budget_s: float) -> dict[str, Any]:
    """A bystander's encode and chat_prompt, alone and while a template loops to its budget."""
    tok = AsyncTokenizer(tokenizer, template_time_budget=budget_s)

    async def encode() -> Any:
        return await tok.encode([SHORT_TEXT])

    async def chat() -> Any:
        return await tok.chat_prompt(CHAT, True, max_model_len=max_model_len)

    try:
        for _ in range(5):  # the threads started and their tokenizer copies taken
            await encode()
            await chat()
        works = {"encode": encode, "chat_prompt": chat}
        alone = await _sample(works, NUM_SAMPLES, None)
        start = time.perf_counter()
        runaway = asyncio.ensure_future(
            tok.chat_prompt(CHAT, True, template=LOOPS, max_model_len=max_model_len)
        )
        await asyncio.sleep(0.2)  # rendering now
        during = await _sample(works, NUM_SAMPLES * 10, runaway)
        try:
            await runaway
            outcome = "rendered"
        except ValueError as error:
            outcome = str(error)
        runaway_s = time.perf_counter() - start
    finally:
        tok.shutdown()
    result: dict[str, Any] = {"runaway_s": runaway_s, "runaway_outcome": outcome}
    for name in ("encode", "chat_prompt"):
        a, d = summary_ms(alone[name]), summary_ms(during[name])
        ratio = d["median_ms"] / a["median_ms"] if d["median_ms"] is not None else None
        result[name] = {"alone": a, "during": d, "ratio": ratio}
    return result


def _reason(reason: str, budget_s: float) -> str:
    """A bomb's expected refusal under `budget_s` (the tests render with a budget of 1 s)."""
    return reason.replace("time budget of 1 s", f"time budget of {budget_s:g} s")


def bombs(tokenizer: Any, max_model_len: int, budget_s: float) -> list[dict[str, Any]]:
    """Every bomb of the tests through chat_prompt with the server's budget and bound."""
    max_chars = max_prompt_chars(max_model_len, max_token_chars(tokenizer))
    rows = []
    for name, template, reason in BOMBS:
        reason = _reason(reason, budget_s)
        start = time.perf_counter()
        with PeakRss() as rss:
            try:
                chat_prompt(tokenizer, CHAT, template=template, time_budget=budget_s, max_chars=max_chars)
                message = None
            except ValueError as error:
                message = str(error)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "name": name,
                "seconds": seconds,
                "rss_growth_bytes": rss.growth,
                "refused_as_tested": message is not None and reason in message,
                "message": (message or "rendered")[:160],
            }
        )
    return rows


# ---- 2. grammars ----------------------------------------------------------------------------------


async def compile_pool(tokenizer: Any, folder: Path) -> dict[str, Any]:
    """A victim's regex latency alone and behind another client's two slow compiles."""
    backend = StructuredOutputBackend(
        tokenizer, model_config_from_folder(folder).vocab_size, [tokenizer.eos_token_id]
    )
    pool = GrammarCompilePool(
        backend, num_workers=limits.GRAMMAR_COMPILE_WORKERS, timeout_s=limits.GRAMMAR_COMPILE_TIMEOUT_S
    )
    victims = itertools.count(1)

    async def victim() -> Any:  # a new pattern each time: never from the cache
        return await pool.compile(StructuredOutputsParams(regex=f"[a-z]+ [0-9]{{{next(victims)}}}"), "B")

    async def slow(tag: str) -> float | str:
        start = time.perf_counter()
        try:
            await pool.compile(StructuredOutputsParams(json=slow_schema(tag)), "A")
        except ValueError as error:
            return f"refused after {time.perf_counter() - start:.1f} s: {error}"
        return time.perf_counter() - start

    workers: list[Any] = []
    try:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                pool.compile(StructuredOutputsParams(regex=r), c)
                for r, c in [("[a-z]", "w1"), ("[0-9]", "w2")]
            )
        )
        ready_s = time.perf_counter() - start  # both processes started, the vocabulary index sent
        alone = (await _sample({"victim": victim}, NUM_VICTIMS, None))["victim"]
        held = [asyncio.ensure_future(slow(f"p{i}_")) for i in range(2)]
        await asyncio.sleep(0.5)  # A's first compile holds a process, its second waits for A's share
        first_done = asyncio.ensure_future(_first_done(held))
        during = (await _sample({"victim": victim}, NUM_VICTIMS, first_done))["victim"]
        slow_results = await asyncio.gather(*held)
        workers = list(pool._running)
    finally:
        pool.close()
        await asyncio.gather(*(worker.wait() for worker in workers))
    a, d = summary_ms(alone), summary_ms(during)
    return {
        "workers": limits.GRAMMAR_COMPILE_WORKERS,
        "vocab_size": backend.vocab_size,
        "ready_s": ready_s,
        "victim_alone": a,
        "victim_during": d,
        "ratio": d["median_ms"] / a["median_ms"] if d["median_ms"] is not None else None,
        "slow_compiles": slow_results,
        "slow_schema_bytes": len(slow_schema("p0_")),
    }


async def _first_done(futures: Sequence[asyncio.Future[Any]]) -> None:
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)


def ref_chain(repeats: int = 5) -> dict[str, Any]:
    """The 450-definition $ref chain's time to its refusal, and a 20-definition chain's check."""

    def check(text: str) -> tuple[float, str | None]:
        start = time.perf_counter()
        try:
            StructuredOutputsParams(json=text)
            return time.perf_counter() - start, None
        except ValueError as error:
            return time.perf_counter() - start, str(error)

    chain, short = ref_chain_schema_text(450), ref_chain_schema_text(20)
    refused = [check(chain) for _ in range(repeats)]
    accepted = [check(short) for _ in range(repeats)]
    return {
        "chain_bytes": len(chain),
        "refusal": summary_ms([s for s, _ in refused]),
        "message": refused[0][1],
        "short_chain_accepted": summary_ms([s for s, _ in accepted]),
        "short_chain_error": accepted[0][1],
    }


# ---- 3. model files -------------------------------------------------------------------------------


def _as_plan_reads(path: Path) -> None:
    read_model_config(str(path))


def _as_serve_reads(path: Path) -> None:
    model_config_from_folder(resolve_model_folder(str(path)))


READERS = {"plan": _as_plan_reads, "serve": _as_serve_reads}


def model_files(folder: Path) -> dict[str, Any]:
    """Every case through both readers: time to the error, failures, RSS; the bases beside them."""
    base_gguf = folder / "base.gguf"
    base_gguf.write_bytes(build_gguf(base_spec("llama")))
    bases = {"gguf": base_gguf, "hf": write_hf(folder / "base-hf")}
    baseline: dict[str, Any] = {}
    for (kind, path), (reader, load) in itertools.product(bases.items(), READERS.items()):
        try:
            load(path)  # any first-use cost (a GGUF's conversion) out of the timing
        except Exception as error:  # a base this reader cannot take is no baseline: said, not fatal
            baseline[f"{reader} {kind}"] = {"n": 0, "error": f"{type(error).__name__}: {error}"}
            continue
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            load(path)
            seconds.append(time.perf_counter() - start)
        baseline[f"{reader} {kind}"] = summary_ms(seconds)
    times: dict[str, list[float]] = {name: [] for name in READERS}
    failures = []
    cases = all_cases()
    with PeakRss() as rss:
        for case in cases:
            (folder / case.name).mkdir()
            path = case.make(folder / case.name)
            for reader, load in READERS.items():
                start = time.perf_counter()
                try:
                    load(path)
                    failures.append(f"{case.name} ({reader}): no error")
                except ModelLoadError as error:
                    message = str(error)
                    if "\n" in message or str(path) not in message or not re.search(case.expect, message):
                        failures.append(f"{case.name} ({reader}): {message[:200]}")
                except Exception as error:
                    failures.append(f"{case.name} ({reader}): {type(error).__name__}: {str(error)[:200]}")
                times[reader].append(time.perf_counter() - start)
    return {
        "cases": len(cases),
        "failures": failures,
        "baseline": baseline,
        "to_error": {reader: summary_ms(seconds) for reader, seconds in times.items()},
        "rss_growth_bytes": rss.growth,
        "process_peak_rss_bytes": vm_hwm_bytes(),
    }


def vm_hwm_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident memory: its address space's own high-water mark (VmHWM). Not
    ru_maxrss, which Linux carries across exec from the parent that forked it (this process's
    peak would count as every child's). None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmHWM:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def run_cli(argv: list[str], timeout_s: float = 300.0) -> dict[str, Any]:
    """`python -m pagedllm ARGV` in a child: exit status, stderr's lines, wall time, and its peak
    RSS (VmHWM polled every 5 ms until it exits: a high-water mark, so only a rise in its last
    5 ms could be missed)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    env.pop("PAGEDLLM_LOGGING_LEVEL", None)
    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "pagedllm", *argv],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=REPO,
            env=env,
        )
        peak = 0
        while child.poll() is None and time.perf_counter() - start < timeout_s:
            peak = max(peak, vm_hwm_bytes(child.pid) or 0)  # a zombie has no VmHWM: kept as it was
            time.sleep(0.005)
        child.kill()  # past the timeout only; a no-op once it has exited
        status = child.wait()
        seconds = time.perf_counter() - start
        stderr.seek(0)
        lines = [line for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    return {"exit": status, "stderr": lines, "wall_s": seconds, "peak_rss_bytes": peak}


def cli_cases(folder: Path) -> dict[str, Any]:
    cases = {case.name: case for case in all_cases()}
    base = folder / "cli-base.gguf"
    base.write_bytes(build_gguf(base_spec("llama")))
    result = {"baseline (plan, undamaged)": run_cli(["plan", "--model", str(base)])}
    for name in CLI_CASES:
        (folder / f"cli-{name}").mkdir()
        path = cases[name].make(folder / f"cli-{name}")
        result[name] = run_cli(["generate", "Hello", "--max-tokens", "1", "--model", str(path)])
    return result


# ---- 4. served ------------------------------------------------------------------------------------

STORY = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
"""The bystander: a streamed greedy completion of 200 tokens."""
RSS_POLL_S = 0.05


def server_args(budget_s: float, max_model_len: int) -> list[str]:
    """`pagedllm serve` flags: client templates trusted, the tests' model length, float32."""
    return [
        "--trust-request-chat-template",
        "--chat-template-time-budget",
        f"{budget_s:g}",
        "--kv-cache-memory-bytes",
        "256MiB",
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        "float32",
    ]


class PeakServerRss:
    """The server's resident memory (its own pid) at its highest while the block runs, polled on a
    thread every RSS_POLL_S (a rise and fall within one interval is seen only in VmHWM)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)

    def __enter__(self) -> PeakServerRss:
        self.before = self.peak = self.process.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while not self.done.wait(RSS_POLL_S):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[float], str]:
    """A completion streamed whole: perf_counter when it was sent, then at each chunk; its text."""
    times, text = [time.perf_counter()], ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the bystander's stream: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"the bystander's stream: {chunk}")
                if chunk["choices"]:
                    times.append(time.perf_counter())
                    text += chunk["choices"][0]["text"]
    return times, text


def _gaps(times: list[float], until: float | None = None) -> list[tuple[float, float]]:
    """(when it ended, seconds) of each gap between a stream's chunks (not the first token's
    wait); with `until`, only the gaps that ended by then."""
    return [(b, b - a) for a, b in itertools.pairwise(times[1:]) if until is None or b <= until]


def _in_flight(rows: list[dict[str, Any]], at: float) -> list[dict[str, Any]]:
    return [row for row in rows if row["start"] <= at <= row["start"] + row["seconds"]]


async def _post_bomb(client: httpx.AsyncClient, name: str, template: str, reason: str) -> dict[str, Any]:
    body = {"messages": CHAT, "chat_template": template, "max_tokens": 1}  # 1: were one rendered
    start = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text
    return {
        "name": name,
        "status": response.status_code,
        "start": start,
        "seconds": seconds,
        "refused_as_tested": response.status_code == 400 and reason in message,
        "message": message[:160],
    }


async def _send_bombs(client: httpx.AsyncClient, budget_s: float) -> tuple[list[dict[str, Any]], float]:
    """Every bomb, one after another; the rows and when the last answer came."""
    rows = [await _post_bomb(client, name, t, _reason(reason, budget_s)) for name, t, reason in BOMBS]
    return rows, time.perf_counter()


async def served_figures(server: ServerProcess, budget_s: float) -> dict[str, Any]:
    """The bystander's stream alone then beside the bombs; /tokenize alone then beside a loop."""
    assert server.url is not None  # ServerProcess returns once the server has said where it listens
    pid = server.proc.pid
    # A new connection per call: on a kept-alive one a response written in two pieces (headers,
    # body) waits for the client's delayed ACK (~40 ms) where the server's socket lacks TCP_NODELAY,
    # as it did at git 7763d3d (asyncio sets it only on sockets made with proto IPPROTO_TCP).
    # The kept-alive figure is taken once, alone, beside the others.
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=300, limits=fresh) as client,
        httpx.AsyncClient(base_url=server.url, timeout=300) as kept_alive,
    ):

        async def tokenize(on: httpx.AsyncClient = client) -> Any:
            response = await on.post("/tokenize", json={"prompt": SHORT_TEXT})
            response.raise_for_status()

        await _stream(client, {**STORY, "max_tokens": 8})  # the first step's one-time costs
        for _ in range(5):
            await tokenize()
            await tokenize(kept_alive)
        alone_times, alone_text = await _stream(client, STORY)
        tokenize_alone = (await _sample({"tokenize": tokenize}, NUM_SAMPLES, None))["tokenize"]
        tokenize_kept_alive = await _sample(
            {"tokenize": lambda: tokenize(kept_alive)}, NUM_SAMPLES // 5, None
        )
        hwm_before = vm_hwm_bytes(pid)
        with PeakServerRss(pid) as rss:
            sender = asyncio.ensure_future(_send_bombs(client, budget_s))
            streams = []
            while not sender.done():  # the bystander streams again until the last bomb is answered
                streams.append(await _stream(client, STORY))
            bomb_rows, bombs_end = await sender
            loop = asyncio.ensure_future(
                _post_bomb(client, "loops without output", LOOPS, _reason("time budget of 1 s", budget_s))
            )
            await asyncio.sleep(0.2)  # rendering now
            tokenize_during = (await _sample({"tokenize": tokenize}, NUM_SAMPLES * 10, loop))["tokenize"]
            loop_row = await loop
        await asyncio.sleep(1.0)  # anything freed when the requests ended, freed
        rss_after, hwm_after = psutil.Process(pid).memory_info().rss, vm_hwm_bytes(pid)
    bystander = _bystander(alone_times, alone_text, streams, bomb_rows, bombs_end, budget_s)
    for row in [*bomb_rows, loop_row]:  # perf_counter -> seconds after the first bomb was sent
        row["start"] -= bomb_rows[0]["start"]
    tok_alone, tok_during = summary_ms(tokenize_alone), summary_ms(tokenize_during)
    return {
        "bystander": bystander,
        "bombs": bomb_rows,
        "tokenize": {
            "alone": tok_alone,
            "during_loop": tok_during,
            "ratio": tok_during["median_ms"] / tok_alone["median_ms"] if tok_during["n"] else None,
            "loop": loop_row,
            "alone_kept_alive": summary_ms(tokenize_kept_alive["tokenize"]),
        },
        "rss": {
            "before_bytes": rss.before,
            "peak_bytes": rss.peak,
            "after_bytes": rss_after,
            "vm_hwm_before_bytes": hwm_before,
            "vm_hwm_after_bytes": hwm_after,
        },
    }


def _bystander(
    alone_times: list[float],
    alone_text: str,
    streams: list[tuple[list[float], str]],
    bomb_rows: list[dict[str, Any]],
    bombs_end: float,
    budget_s: float,
) -> dict[str, Any]:
    """The stream's gaps alone and while the bombs were sent (those that ended by the last answer),
    the gaps while a loop rendered, and which bombs were in flight at the largest."""
    alone = summary_ms([gap for _, gap in _gaps(alone_times)])
    gaps = [pair for times, _ in streams for pair in _gaps(times, until=bombs_end)]
    during = summary_ms([gap for _, gap in gaps])
    loops = [row for row in bomb_rows if row["seconds"] >= budget_s]
    worst = _in_flight(bomb_rows, max(gaps, key=lambda pair: pair[1])[0]) if gaps else []
    return {
        "tokens": STORY["max_tokens"],
        "alone": {**alone, "chunks": len(alone_times) - 1, "ttft_s": alone_times[1] - alone_times[0]},
        "during_bombs": {**during, "streams": len(streams)},
        "during_loops": summary_ms([gap for end, gap in gaps if _in_flight(loops, end)]),
        "largest_gap_during": [row["name"] for row in worst],
        "max_ratio": during["max_ms"] / alone["max_ms"] if during["n"] else None,
        "median_ratio": during["median_ms"] / alone["median_ms"] if during["n"] else None,
        "same_text": all(text == alone_text for _, text in streams),
    }


def served(
    budget_s: float, max_model_len: int, num_threads: int | None, log_path: str | None
) -> dict[str, Any]:
    """Part 4 against a server of its own; its log's thread-count changes kept (by default the
    server follows the cores other processes leave free, which moves a stream's gaps)."""
    args = server_args(budget_s, max_model_len)
    if num_threads is not None:
        args += ["--num-threads", str(num_threads)]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(log_path or Path(tmp) / "server.log")
        start = time.perf_counter()
        server = ServerProcess(args, log_path=log)
        try:
            ready_s = time.perf_counter() - start
            figures = asyncio.run(served_figures(server, budget_s))
        finally:
            server.stop()
        threads = [line.strip() for line in log.read_text().splitlines() if "CPU threads:" in line]
    return {"command": "pagedllm serve " + " ".join(args), "ready_s": ready_s, "threads": threads, **figures}


# ---- report ---------------------------------------------------------------------------------------


def _ms(row: dict[str, Any]) -> str:
    if not row["n"]:
        return "no sample"
    return f"{row['median_ms']:.2f} ms (n={row['n']}, max {row['max_ms']:.2f})"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def report(results: dict[str, Any]) -> str:
    """The figures as markdown tables (baseline, under attack, ratio), then what each refusal said."""
    lines = [f"host: {results['host']}; git {results['git']}"]
    if "templates" in results:
        lines += [results["setup"], "", *offline_report(results)]
    if "served" in results:
        lines += ["", *served_report(results["served"], results["budget_s"])]
    return "\n".join(lines)


def offline_report(results: dict[str, Any]) -> list[str]:
    t, p, r, m = results["templates"], results["grammars"], results["ref_chain"], results["model_files"]
    rows = [("figure", "baseline (same run)", "hostile", "ratio"), ("---",) * 4]
    for name in ("encode", "chat_prompt"):
        row = t["bystanders"][name]
        during = f"during the runaway render {_ms(row['during'])}"
        rows.append((f"bystander {name}, median", f"alone {_ms(row['alone'])}", during, _ratio(row["ratio"])))
    during = f"behind 2 slow compiles of client A {_ms(p['victim_during'])}"
    rows.append(
        ("victim regex compile (client B)", f"alone {_ms(p['victim_alone'])}", during, _ratio(p["ratio"]))
    )
    accepted = f"20-def chain accepted in {_ms(r['short_chain_accepted'])}"
    rows.append(
        (f"$ref chain, 450 defs ({r['chain_bytes']:,} B)", accepted, f"refused in {_ms(r['refusal'])}", "")
    )
    rows += _bomb_rows(t["bombs"], t["budget_s"])
    for reader, row in m["to_error"].items():
        bases = {
            k.split()[1]: v["median_ms"] for k, v in m["baseline"].items() if k.startswith(reader) and v["n"]
        }
        base_text = "undamaged " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in bases.items())
        ratio = f"{row['median_ms'] / max(bases.values()):.2f} (median / slower base)"
        rows.append(
            (f"{m['cases']} hostile files as `{reader}` reads, to the error", base_text, _ms(row), ratio)
        )
    peak = f"growth {_mib(m['rss_growth_bytes'])}; process peak {_mib(m['process_peak_rss_bytes'])}"
    rows.append(("hostile files: RSS", "", peak, ""))
    cli = dict(results["cli"])
    base_run = cli.pop("baseline (plan, undamaged)")
    base_text = (
        f"`plan --model` the undamaged base: exit {base_run['exit']}, {base_run['wall_s']:.2f} s, "
        f"{_mib(base_run['peak_rss_bytes'])}"
    )
    for name, run in cli.items():
        hostile = (
            f"exit {run['exit']}, {len(run['stderr'])} stderr line(s), {run['wall_s']:.2f} s, "
            f"{_mib(run['peak_rss_bytes'])}"
        )
        ratio = f"{run['wall_s'] / base_run['wall_s']:.2f} (wall)"
        rows.append((f"`generate --model` {name}", base_text, hostile, ratio))
    notes = [
        f"runaway template: {t['bystanders']['runaway_s']:.2f} s, then {t['bystanders']['runaway_outcome']!r}"
    ]
    notes.append(
        f"slow compiles ({p['slow_schema_bytes']:,} B, {p['vocab_size']:,} tokens): {p['slow_compiles']}"
    )
    notes.append(f"$ref chain: {r['message']!r}")
    notes += [f"model file failure: {failure}" for failure in m["failures"]] or ["model files: no failures"]
    notes += [f"{name}: {run['stderr'][-1] if run['stderr'] else ''}" for name, run in cli.items()]
    notes += [
        f"bomb not refused as tested: {b['name']}: {b['message']}"
        for b in t["bombs"]
        if not b["refused_as_tested"]
    ]
    return ["| " + " | ".join(row) + " |" for row in rows] + ["", *notes]


def served_report(s: dict[str, Any], budget_s: float) -> list[str]:
    b, tok, rss, bombs_ = s["bystander"], s["tokenize"], s["rss"], s["bombs"]
    loops = [row["name"] for row in bombs_ if row["seconds"] >= budget_s]
    alone, during = b["alone"], b["during_bombs"]
    streamed = f"while the bombs were sent ({during['streams']} streams, n={during['n']} gaps)"
    rows = [
        ("figure (served)", "baseline (same run)", "hostile", "ratio"),
        ("---",) * 4,
        (
            f"bystander stream ({b['tokens']} tokens), largest gap between chunks",
            f"alone {alone['max_ms']:.1f} ms (n={alone['n']} gaps; first token {alone['ttft_s']:.2f} s)",
            f"{streamed} {during['max_ms']:.1f} ms" if during["n"] else "no sample",
            _ratio(b["max_ratio"]),
        ),
        (
            "bystander stream, median gap",
            f"alone {alone['median_ms']:.1f} ms",
            f"while the bombs were sent {during['median_ms']:.1f} ms" if during["n"] else "no sample",
            _ratio(b["median_ratio"]),
        ),
        (
            f"bystander stream, median gap while one of the {len(loops)} loops renders",
            f"alone {alone['median_ms']:.1f} ms",
            _ms(b["during_loops"]),
            _ratio(b["during_loops"]["median_ms"] / alone["median_ms"] if b["during_loops"]["n"] else None),
        ),
        (
            "bystander `/tokenize`, median",
            f"alone {_ms(tok['alone'])}",
            f"while a template loops to the {budget_s:g} s budget {_ms(tok['during_loop'])}",
            _ratio(tok["ratio"]),
        ),
        (
            "bystander `/tokenize` on one kept-alive connection, median",
            f"alone {_ms(tok['alone_kept_alive'])}",
            "",
            "",
        ),
    ]
    statuses = dict(sorted(collections.Counter(row["status"] for row in bombs_).items()))
    slowest = max(bombs_, key=lambda row: row["seconds"])
    quick = [row["seconds"] for row in bombs_ if row["seconds"] < budget_s]
    in_time = sum(row["seconds"] <= budget_s + 1 for row in bombs_)
    refused = sum(row["refused_as_tested"] for row in bombs_)
    latency = (
        f"statuses {statuses}; median {statistics.median(r['seconds'] for r in bombs_) * 1e3:.1f} ms, "
        f"max {slowest['seconds']:.2f} s ({slowest['name']}); the {len(quick)} under the budget: "
        f"max {max(quick, default=0) * 1e3:.1f} ms; {in_time} within the budget + 1 s"
    )
    rows.append((f"{len(bombs_)} bombs as requests ({refused} refused as tested)", "", latency, ""))
    hwm = f"; VmHWM {_mib(rss['vm_hwm_before_bytes'])} -> {_mib(rss['vm_hwm_after_bytes'])}"
    growth = (
        f"peak {_mib(rss['peak_bytes'])} (+{_mib(rss['peak_bytes'] - rss['before_bytes'])}), after "
        f"{_mib(rss['after_bytes'])} ({rss['after_bytes'] - rss['before_bytes']:+,} B){hwm}"
    )
    rows.append(("server RSS (its pid, every 50 ms)", f"before {_mib(rss['before_bytes'])}", growth, ""))
    loop = tok["loop"]
    notes = [
        f"server: {s['command']} (ready in {s['ready_s']:.1f} s)",
        f"bystander's text while the bombs were sent: {'as alone' if b['same_text'] else 'DIFFERENT'}",
        f"server thread counts: {' | '.join(s['threads'])}",
        f"bombs in flight at the bystander's largest gap: {', '.join(b['largest_gap_during']) or 'none'}",
        f"the loop beside /tokenize: {loop['status']} in {loop['seconds']:.2f} s: {loop['message']!r}",
    ]
    notes += [
        f"bomb not refused as tested: {row['name']}: {row['status']} {row['message']}"
        for row in bombs_
        if not row["refused_as_tested"]
    ]
    return ["| " + " | ".join(row) + " |" for row in rows] + ["", *notes]


def _bomb_rows(bombs_: list[dict[str, Any]], budget_s: float) -> list[tuple[str, str, str, str]]:
    refused = sum(row["refused_as_tested"] for row in bombs_)
    slowest = max(bombs_, key=lambda row: row["seconds"])
    quick = [row["seconds"] for row in bombs_ if row["seconds"] < budget_s]
    fattest = max(bombs_, key=lambda row: row["rss_growth_bytes"])
    median_ms = statistics.median(row["seconds"] for row in bombs_) * 1e3
    times = (
        f"median {median_ms:.1f} ms, max {slowest['seconds']:.2f} s ({slowest['name']}); "
        f"the {len(quick)} not looping: max {max(quick) * 1e3:.1f} ms"
    )
    return [
        (f"{len(bombs_)} template bombs ({refused} refused as tested): to the refusal", "", times, ""),
        (
            "template bombs: RSS growth",
            "",
            f"max {_mib(fattest['rss_growth_bytes'])} ({fattest['name']})",
            "",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-model-len", type=int, default=1024, help="the template bound's model length (the tests')"
    )
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--served", action="store_true", help="also part 4, against a server (~1 min more)")
    parts.add_argument("--served-only", action="store_true", help="part 4 only")
    parser.add_argument("--server-log", help="the served part's server log (default: not kept)")
    parser.add_argument(
        "--server-threads",
        type=int,
        help="the served part's --num-threads (default: the server's own choice)",
    )
    parser.add_argument("--output-json")
    args = parser.parse_args()
    budget_s = limits.CHAT_TEMPLATE_TIME_BUDGET_S
    results: dict[str, Any] = {"host": describe_host(), "git": git_sha(), "budget_s": budget_s}
    if not args.served_only:
        results.update(offline(args.max_model_len, budget_s))
    if args.served or args.served_only:
        results["served"] = served(budget_s, args.max_model_len, args.server_threads, args.server_log)
    if args.output_json:  # first: the figures kept whatever the report makes of them
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    print(report(results))


def offline(max_model_len: int, budget_s: float) -> dict[str, Any]:
    """Parts 1 to 3: the model files first (the process's peak RSS is then its imports and corpus)."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["model_files"] = model_files(Path(tmp))
        results["cli"] = cli_cases(Path(tmp))
    folder = resolve_model_folder(None)
    tokenizer = load_tokenizer(folder)
    max_chars = max_prompt_chars(max_model_len, max_token_chars(tokenizer))
    results["setup"] = (
        f"model {folder.name}; template budget {budget_s:g} s, bound of max_model_len {max_model_len} "
        f"({max_chars:,} chars); no model is run (no dtype)"
    )
    results["templates"] = {
        "budget_s": budget_s,
        "bystanders": asyncio.run(bystanders(tokenizer, max_model_len, budget_s)),
        "bombs": bombs(tokenizer, max_model_len, budget_s),
    }
    results["grammars"] = asyncio.run(compile_pool(tokenizer, folder))
    results["ref_chain"] = ref_chain()
    return results


if __name__ == "__main__":
    main()
