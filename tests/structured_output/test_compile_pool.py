"""The grammar compile pool (issue 45): a process that died or hung while idle is replaced before
it is handed out, a failure that is not the grammar's is retried once and then a 503-type error
(CompilerUnavailableError, never a 400 telling the request to simplify), a grammar that kills its
process twice is the 400; one client's slow compiles leave a process to another client's regex;
the same grammar asked twice compiles once. Real compile processes on a 96-token vocabulary;
tests/slow_compile_worker.py stands in for grammars that are slow or crash."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import xgrammar

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import grammar_key
from pagedllm.structured_output.compile_pool import CompilerUnavailableError, GrammarCompilePool
from pagedllm.structured_output.fair_slots import FairSlots

from ..schema_bombs import LINKED_LIST, TREE

TEST_WORKER = "tests.slow_compile_worker"
SLOW_COMPILE_S = 3.0


class TinyBackend:
    """What the pool needs of StructuredOutputBackend, on printable ASCII plus a stop token."""

    def __init__(self) -> None:
        vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
        self.info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
        self.cache: dict[Any, xgrammar.CompiledGrammar] = {}

    def cached(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar | None:
        return self.cache.get(grammar_key(params))

    def put(self, params: StructuredOutputsParams, compiled: xgrammar.CompiledGrammar) -> None:
        self.cache[grammar_key(params)] = compiled

    def tokenizer_info_json(self) -> str:
        return self.info.serialize_json()

    def deserialize(self, compiled_json: str) -> xgrammar.CompiledGrammar:
        return xgrammar.CompiledGrammar.deserialize_json(compiled_json, self.info)


def make_pool(**kwargs: Any) -> GrammarCompilePool:
    options: dict[str, Any] = {"num_workers": 2, "timeout_s": 60.0, "worker_module": TEST_WORKER}
    return GrammarCompilePool(TinyBackend(), **(options | kwargs))  # type: ignore[arg-type]


def regex(pattern: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=pattern)


def run(coroutine_fn: Any, **pool_options: Any) -> None:
    """Run a test's body with its own pool, closed (its processes killed) whatever happens."""

    async def body() -> None:
        pool = make_pool(**pool_options)
        pool._running = started = _Started()
        try:
            await coroutine_fn(pool)
        finally:
            pool.close()
            await asyncio.gather(*(worker.wait() for worker in started.ever))  # reaped before the loop ends

    asyncio.run(body())


class _Started(set):
    """The pool's set of running workers, remembering every worker ever in it (killed ones too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ever: list[Any] = []

    def add(self, worker: Any) -> None:
        self.ever.append(worker)
        super().add(worker)


@pytest.fixture(autouse=True)
def _slow_compile_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_TEST_SLOW_COMPILE_S", str(SLOW_COMPILE_S))
    monkeypatch.setenv("PAGEDLLM_TEST_CRASH_FLAG", str(tmp_path / "crashed"))


@pytest.mark.slow  # the fast set keeps a pool's compile and its retry
def test_recursive_schemas_compile():
    async def body(pool: GrammarCompilePool) -> None:
        for schema in (LINKED_LIST, TREE):
            assert await pool.compile(StructuredOutputsParams(json=schema)) is not None

    run(body)


@pytest.mark.slow  # idle workers killed or stopped and replaced
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["died", "hung"])
def test_a_worker_that_died_or_hung_while_idle_is_replaced_not_blamed(how):
    async def body(pool: GrammarCompilePool) -> None:
        await pool.compile(regex("[a-z]+"))
        [pid] = pool.worker_pids
        os.kill(pid, how)
        if how == signal.SIGKILL:
            await asyncio.sleep(0.2)  # dead, and maybe reaped: both must be handled
        assert await pool.compile(regex("[0-9]+")) is not None  # no ValueError
        assert pid not in pool.worker_pids  # the hung one killed, not left stopped

    run(body, ping_timeout_s=1.0)


def test_a_worker_that_dies_compiling_once_is_retried():
    async def body(pool: GrammarCompilePool) -> None:
        assert await pool.compile(regex("crash-once[a-z]")) is not None

    run(body)


@pytest.mark.slow  # a worker killed twice; the fast set keeps one killed once and retried
def test_a_grammar_that_kills_its_worker_twice_is_a_400():
    async def body(pool: GrammarCompilePool) -> None:
        with pytest.raises(ValueError, match="died compiling it twice"):
            await pool.compile(regex("crash[a-z]"))
        assert await pool.compile(regex("[a-z]+")) is not None  # the pool goes on

    run(body)


def test_workers_that_cannot_start_are_a_503_not_a_400():
    async def body(pool: GrammarCompilePool) -> None:
        with pytest.raises(CompilerUnavailableError, match=r"failed to start.*then.*failed to start"):
            await pool.compile(regex("[a-z]+"))

    run(body, worker_module="tests.no_such_compile_worker")


@pytest.mark.slow  # compiles that run to their time budget
def test_a_clients_slow_compiles_leave_a_worker_to_another_client():
    """Client A holds two slow (legal) compiles; client B's trivial regex is answered before
    either of them, not queued behind them."""

    async def body(pool: GrammarCompilePool) -> None:
        await asyncio.gather(pool.compile(regex("[a-z]"), "warm-1"), pool.compile(regex("[0-9]"), "warm-2"))
        assert len(pool.worker_pids) == 2  # both processes started: no start time in what follows
        done: dict[str, float] = {}
        start = time.monotonic()

        async def timed(name: str, params: StructuredOutputsParams, client: str) -> None:
            await pool.compile(params, client)
            done[name] = time.monotonic() - start

        slow = [asyncio.ensure_future(timed(f"slow-{i}", regex(f"slow{i}[a-z]+"), "A")) for i in range(2)]
        await asyncio.sleep(0.5)  # A's first holds a process, its second waits for A's share
        await timed("victim", regex("[a-z]+ [a-z]+"), "B")
        await asyncio.gather(*slow)
        assert done["victim"] < min(done["slow-0"], done["slow-1"]), done
        assert done["victim"] < 0.5 + 10, done

    run(body)


def test_the_same_grammar_asked_twice_compiles_once():
    async def body(pool: GrammarCompilePool) -> None:
        first, second = await asyncio.gather(
            pool.compile(regex("shared[a-z]"), "A"), pool.compile(regex("shared[a-z]"), "B")
        )  # both asked before the first's reply can come back: the second waits on the first's compile
        assert first is second  # one compile, one deserialized grammar
        assert len(pool.worker_pids) == 1  # the second process was never needed

    run(body)


def test_fair_slots_share_order_cancel_and_close():
    async def body() -> None:
        slots: FairSlots[str] = FairSlots(2, max_per_client=1)
        assert await slots.take("A") is None
        a2 = asyncio.ensure_future(slots.take("A"))  # over A's share: waits
        b1 = asyncio.ensure_future(slots.take("B"))  # behind A's in line, but under its share
        await asyncio.sleep(0)
        assert b1.done() and not a2.done()
        c1 = asyncio.ensure_future(slots.take("C"))
        await asyncio.sleep(0)
        slots.give_back("B", "worker-b")
        a2.cancel()  # handed nothing yet: leaves the line
        await asyncio.sleep(0)
        assert await c1 == "worker-b"
        slots.close(RuntimeError("closed"))
        with pytest.raises(RuntimeError, match="closed"):
            await slots.take("D")

    asyncio.run(body())


def test_fair_slots_a_waiter_handed_a_place_as_it_is_cancelled_passes_it_on():
    async def body() -> None:
        slots: FairSlots[str] = FairSlots(1, max_per_client=1)
        await slots.take("A")
        b = asyncio.ensure_future(slots.take("B"))
        c = asyncio.ensure_future(slots.take("C"))
        await asyncio.sleep(0)
        slots.give_back("A", "worker")  # B's future gets the place ...
        b.cancel()  # ... and B goes before it runs: the place must reach C
        await asyncio.sleep(0)
        assert await c == "worker"
        assert b.cancelled()

    asyncio.run(body())


def test_fair_slots_unnamed_requests_have_no_share():
    async def body() -> None:
        slots: FairSlots[str] = FairSlots(2, max_per_client=1)
        assert [await slots.take(None), await slots.take(None)] == [None, None]
        waiting = asyncio.ensure_future(slots.take("A"))
        await asyncio.sleep(0)
        assert not waiting.done()  # both places are held: no reservation for anyone
        slots.give_back(None, "w")
        assert await waiting == "w"

    asyncio.run(body())


def test_no_compile_process_is_a_503_with_retry_after():
    """What the server answers for CompilerUnavailableError (the engine's mapping, then the API's)."""
    from http import HTTPStatus

    from pagedllm.engine.async_engine import AsyncLLM, EngineUnavailableError
    from pagedllm.entrypoints.openai.errors import to_api_error

    class NoProcesses:
        async def compile(self, params: StructuredOutputsParams, client: str | None) -> None:
            raise CompilerUnavailableError(
                "structured_outputs.regex: no grammar compile process is available"
            )

    from types import SimpleNamespace

    from pagedllm.config import EngineConfig

    core = SimpleNamespace(config=EngineConfig(), facts=None)  # the pool is all this path touches
    engine = AsyncLLM(core, None, None)  # type: ignore[arg-type]
    engine._grammar_pool = NoProcesses()  # type: ignore[assignment]
    with pytest.raises(EngineUnavailableError) as error:
        asyncio.run(engine._compile_grammar(regex("[a-z]"), client="A"))
    api_error = to_api_error(error.value)
    assert api_error.status == HTTPStatus.SERVICE_UNAVAILABLE and api_error.headers == {"Retry-After": "1"}
    assert "no grammar compile process" in api_error.info.message
