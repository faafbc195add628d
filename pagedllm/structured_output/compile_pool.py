"""GrammarCompilePool: the server's grammar compiles, each bounded by construction.

xgrammar cannot interrupt a compile, and some grammars take minutes (a 15 KB schema nesting 450
objects: 25-45 s). A thread could only abandon such a compile, still burning a core and holding
its place; so compiles run in a few worker processes (compile_worker.py) and:

- a compile that overruns `timeout_s` gets its ValueError (a 400) at once and its process is
  killed, so no compile holds a worker past the timeout;
- with `num_workers` processes a runaway delays no one else's compile, and a request's timeout
  runs from when its own compile starts, never from when it began waiting for a worker;
- `close()` kills the processes: nothing waits for a compile at exit, and a compile cut by it
  raises PoolClosedError.

A compiled grammar comes back as xgrammar's JSON and is deserialized here against the same
vocabulary index. A request whose client goes away leaves its compile to finish (or time out) in
the background: killing it would let a client force process restarts (~2 s of CPU each) for free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import TYPE_CHECKING

from pagedllm.structured_output import compile_worker
from pagedllm.structured_output.backend import GrammarKey, StructuredOutputBackend, grammar_key
from pagedllm.structured_output.compile_worker import HEADER

if TYPE_CHECKING:
    import xgrammar

    from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
"""A worker that is not ready by then (importing xgrammar and torch) is a server fault."""


class PoolClosedError(Exception):
    """The pool was closed (the server is shutting down) before this compile finished."""


class GrammarCompilePool:
    """Compiles grammars in worker processes; see the module docstring. Event loop only."""

    def __init__(self, backend: StructuredOutputBackend, *, num_workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._backend = backend
        self._num_workers = num_workers
        # last in, first out: a running worker is taken before a place with no process (None)
        self._idle: asyncio.LifoQueue[_Worker | None] | None = None
        self._running: set[_Worker] = set()
        self._tokenizer_info: bytes | None = None
        self._is_closed = False

    async def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar, from the backend's cache or a worker (then cached). ValueError
        (a 400) if it is invalid or takes over `timeout_s`; PoolClosedError if closed first."""
        compiled = self._backend.cached(params)
        if compiled is None:
            key = grammar_key(params)
            worker = await self._acquire()
            run = asyncio.ensure_future(self._run(worker, key))
            run.add_done_callback(_retrieve)  # its error is the caller's, who may have gone
            compiled_json = await asyncio.shield(run)  # a caller that goes leaves it to end in time
            compiled = await asyncio.to_thread(self._backend.deserialize, compiled_json)
            self._backend.put(params, compiled)
        return compiled

    def close(self) -> None:
        """Kill every worker now; compiles under way and waiting raise PoolClosedError."""
        self._is_closed = True
        for worker in self._running:
            worker.kill()
        self._running.clear()
        if self._idle is not None:
            self._idle.put_nowait(None)  # wakes a waiter, which wakes the next (_acquire)

    async def _run(self, worker: _Worker, key: GrammarKey) -> str:
        """One compile on `worker`, which goes back to the pool after it, or is killed."""
        kept: _Worker | None = None
        try:
            status, payload = await asyncio.wait_for(worker.ask(json.dumps(key).encode()), self.timeout_s)
            kept = worker
        except TimeoutError:
            raise ValueError(
                f"structured_outputs.{key[0]}: took over {self.timeout_s:g} s to compile; simplify it"
            ) from None
        except (ConnectionError, asyncio.IncompleteReadError):
            if self._is_closed:
                raise PoolClosedError("the server is shutting down") from None
            raise ValueError(
                f"structured_outputs.{key[0]}: the compiler process died compiling it; simplify it"
            ) from None
        finally:
            if kept is None:
                worker.kill()
                self._running.discard(worker)
            self._release(kept)
        if status == compile_worker.INVALID:
            raise ValueError(payload.decode())
        return payload.decode()

    async def _acquire(self) -> _Worker:
        """An idle worker, started if its place has none; waiting for one is not compile time."""
        if self._idle is None:
            self._idle = asyncio.LifoQueue()
            for _ in range(self._num_workers):
                self._idle.put_nowait(None)
        worker = await self._idle.get()
        if self._is_closed:
            self._idle.put_nowait(None)
            raise PoolClosedError("the server is shutting down")
        if worker is not None:
            return worker
        try:
            if self._tokenizer_info is None:
                info = await asyncio.to_thread(self._backend.tokenizer_info_json)
                self._tokenizer_info = info.encode()
            worker = await asyncio.wait_for(
                _Worker.start(self._tokenizer_info, self._running), WORKER_START_TIMEOUT_S
            )
        except BaseException:
            self._idle.put_nowait(None)
            raise
        return worker

    def _release(self, worker: _Worker | None) -> None:
        if self._idle is not None and not self._is_closed:
            self._idle.put_nowait(worker)


class _Worker:
    """One compile process and its pipes (the frames of compile_worker)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @classmethod
    async def start(cls, tokenizer_info: bytes, running: set[_Worker]) -> _Worker:
        """A ready worker, in `running` from its start (so that closing the pool kills it)."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            compile_worker.__name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        worker = cls(process)
        running.add(worker)
        try:
            status, _ = await worker.ask(tokenizer_info)
        except BaseException:
            worker.kill()
            running.discard(worker)
            raise
        if status != compile_worker.READY:
            worker.kill()
            running.discard(worker)
            raise RuntimeError(f"the grammar compile process answered {status!r} instead of READY")
        logger.debug("Started grammar compile process %d", process.pid)
        return worker

    async def ask(self, request: bytes) -> tuple[bytes, bytes]:
        """Send one frame, read one back: (status, payload)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(HEADER.pack(compile_worker.REQUEST, len(request)) + request)
        await self._process.stdin.drain()
        status, size = HEADER.unpack(await self._process.stdout.readexactly(HEADER.size))
        return status, await self._process.stdout.readexactly(size)

    def kill(self) -> None:
        if self._process.returncode is None:
            self._process.kill()


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
