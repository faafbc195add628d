"""GrammarCompilePool: the server's grammar compiles, each bounded by construction.

xgrammar cannot interrupt a compile, and some grammars take minutes (a 15 KB schema nesting 450
objects: 25-45 s). A thread could only abandon such a compile, still burning a core and holding
its place; so compiles run in a few worker processes (compile_worker.py) and:

- a compile that overruns `timeout_s` gets its ValueError (a 400) at once and its process is
  killed, so no compile holds a worker past the timeout; a request's timeout runs from when its
  own compile starts, never from when it began waiting for a worker;
- no client holds every process (FairSlots): one client's slow grammars leave a process to the
  others' (`max_per_client`, by default all but one);
- a grammar already compiling for one request is not compiled again for another: the second
  waits for the first's result;
- a process is checked before it is handed out (exited, or no answer to a ping: replaced), and a
  failure that is not the grammar's (a process that could not start, or died compiling once) is
  retried once on a fresh process, then answered with CompilerUnavailableError (a 503, retry
  later), never with a 400 telling the request to simplify. A grammar whose compile outlives the
  timeout, or kills its process on both tries, gets the 400;
- `close()` kills the processes: nothing waits for a compile at exit, and a compile cut by it
  raises PoolClosedError.

A compiled grammar comes back as xgrammar's JSON and is deserialized here against the same
vocabulary index. A request whose client goes away leaves its compile to finish (or time out) in
the background: killing it would let a client force process restarts for free.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import TYPE_CHECKING

from pagedllm.structured_output import compile_worker
from pagedllm.structured_output.backend import GrammarKey, StructuredOutputBackend, grammar_key
from pagedllm.structured_output.compile_worker import INVALID
from pagedllm.structured_output.fair_slots import FairSlots
from pagedllm.structured_output.worker_process import WorkerProcess

if TYPE_CHECKING:
    import xgrammar

    from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
"""A worker that is not ready by then (importing xgrammar and torch) is a server fault."""
PING_TIMEOUT_S = 5.0
"""An idle worker that does not answer a ping by then is hung: it is replaced, not handed out."""
_WORKER_FAULTS = (OSError, EOFError, RuntimeError, TimeoutError)
"""What starting or pinging a worker raises when the process, not a grammar, failed
(ConnectionError and asyncio.IncompleteReadError among them)."""


class PoolClosedError(Exception):
    """The pool was closed (the server is shutting down) before this compile finished."""


class CompilerUnavailableError(Exception):
    """No compile process could compile this grammar, for reasons not the grammar's (a process that
    would not start, or died under it once and then could not be replaced): retry later."""


class GrammarCompilePool:
    """Compiles grammars in worker processes; see the module docstring. Event loop only."""

    def __init__(
        self,
        backend: StructuredOutputBackend,
        *,
        num_workers: int,
        timeout_s: float,
        max_per_client: int | None = None,
        worker_module: str = compile_worker.__name__,
        ping_timeout_s: float = PING_TIMEOUT_S,
    ) -> None:
        """max_per_client: processes one client may hold at once (default: all but one, at
        least one). worker_module: the module whose main() each process runs (tests swap it)."""
        self.timeout_s = timeout_s
        self._backend = backend
        self._slots: FairSlots[WorkerProcess] = FairSlots(
            num_workers, max_per_client=max_per_client or max(1, num_workers - 1)
        )
        self._worker_module = worker_module
        self._ping_timeout_s = ping_timeout_s
        self._running: set[WorkerProcess] = set()
        self._in_flight: dict[GrammarKey, asyncio.Future[xgrammar.CompiledGrammar]] = {}
        self._tokenizer_info: bytes | None = None
        self._is_closed = False

    @property
    def worker_pids(self) -> list[int]:
        """The started compile processes' ids (for logs and tests)."""
        return [pid for worker in self._running if (pid := worker.pid) is not None]

    async def compile(
        self, params: StructuredOutputsParams, client: str | None = None
    ) -> xgrammar.CompiledGrammar:
        """The compiled grammar, from the backend's cache, a compile already under way, or a worker
        (then cached). `client` names who asks, for FairSlots. ValueError (a 400) if it is invalid
        or takes over `timeout_s`; CompilerUnavailableError (a 503) if no process could compile it;
        PoolClosedError if closed first."""
        key = grammar_key(params)
        while True:
            compiled = self._backend.cached(params)
            if compiled is not None:
                return compiled
            run = self._in_flight.get(key)
            if run is not None:
                return await asyncio.shield(run)  # a caller that goes leaves it to end in time
            worker = await self._slots.take(client)  # waiting for a place: no compile time
            if self._backend.cached(params) is None and key not in self._in_flight:
                break
            self._slots.give_back(client, worker)  # compiled meanwhile for someone else
        run = asyncio.ensure_future(self._compile(params, worker, client))
        self._in_flight[key] = run
        run.add_done_callback(functools.partial(self._forget, key))
        return await asyncio.shield(run)

    def close(self) -> None:
        """Kill every worker now; compiles under way and waiting raise PoolClosedError."""
        self._is_closed = True
        self._slots.close(PoolClosedError("the server is shutting down"))
        for worker in self._running:
            worker.kill()
        self._running.clear()

    async def _compile(
        self, params: StructuredOutputsParams, worker: WorkerProcess | None, client: str | None
    ) -> xgrammar.CompiledGrammar:
        """Compile on the place `worker` came from (retried once there, see the module docstring);
        the place goes back to the pool with whatever worker is left alive in it."""
        key = grammar_key(params)
        failures: list[str] = []  # why each try failed, when not by a timeout or a 400
        died_compiling = 0
        try:
            while True:
                try:
                    worker = await self._ready(worker)
                except _WORKER_FAULTS as error:
                    worker = None
                    self._check_open()
                    failures.append(f"a compile process failed to start ({_describe(error)})")
                else:
                    try:
                        status, payload = await self._ask(worker, key)
                        break
                    except (ConnectionError, asyncio.IncompleteReadError):
                        self._drop(worker)
                        worker = None
                        self._check_open()
                        died_compiling += 1
                        failures.append("the compile process died compiling it")
                if len(failures) == 2:
                    if died_compiling == 2:
                        raise ValueError(
                            f"structured_outputs.{key[0]}: the compile process died compiling it twice "
                            "(e.g. out of memory); simplify it"
                        )
                    raise CompilerUnavailableError(
                        f"structured_outputs.{key[0]}: no grammar compile process is available "
                        f"({'; then '.join(failures)}); retry later"
                    )
                logger.warning("Grammar compile retried on a fresh process: %s", failures[-1])
        finally:  # the place keeps its worker if it lives (a timeout or a death killed it)
            self._slots.give_back(client, worker if worker in self._running else None)
        if status == INVALID:
            raise ValueError(payload.decode())
        compiled = await asyncio.to_thread(self._backend.deserialize, payload.decode())
        self._backend.put(params, compiled)
        return compiled

    async def _ask(self, worker: WorkerProcess, key: GrammarKey) -> tuple[bytes, bytes]:
        """One compile, within the timeout (else the worker is killed and the grammar refused)."""
        try:
            return await asyncio.wait_for(worker.ask(json.dumps(key).encode()), self.timeout_s)
        except TimeoutError:
            self._drop(worker)
            raise ValueError(
                f"structured_outputs.{key[0]}: took over {self.timeout_s:g} s to compile; simplify it"
            ) from None

    async def _ready(self, worker: WorkerProcess | None) -> WorkerProcess:
        """`worker` if it is alive and answers a ping, else a fresh one in its place."""
        self._check_open()
        if worker is not None:
            try:
                if worker.returncode is not None:
                    raise EOFError(f"it had exited with code {worker.returncode}")
                await asyncio.wait_for(worker.ping(), self._ping_timeout_s)
                return worker
            except _WORKER_FAULTS as error:
                self._check_open()
                logger.warning(
                    "Grammar compile process %d failed while idle (%s); starting another",
                    worker.pid,
                    _describe(error),
                )
                self._drop(worker)
        if self._tokenizer_info is None:
            info = await asyncio.to_thread(self._backend.tokenizer_info_json)
            self._tokenizer_info = info.encode()
        return await asyncio.wait_for(
            WorkerProcess.start(self._worker_module, self._tokenizer_info, self._running),
            WORKER_START_TIMEOUT_S,
        )

    def _drop(self, worker: WorkerProcess) -> None:
        worker.kill()
        self._running.discard(worker)

    def _check_open(self) -> None:
        if self._is_closed:
            raise PoolClosedError("the server is shutting down")

    def _forget(self, key: GrammarKey, run: asyncio.Future[xgrammar.CompiledGrammar]) -> None:
        if self._in_flight.get(key) is run:
            del self._in_flight[key]
        if not run.cancelled():
            run.exception()  # its error is its callers', who may all have gone


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
