"""AsyncLLM: the server's engine loop, LLMEngine driven by one background thread.

    event loop (HTTP handlers)                        engine thread
    generate(): InputProcessor.process (vocabulary, lengths, limits), the grammar, then
            ------- add command (SimpleQueue) ---->   engine.add_processed(EngineRequest): bookkeeping
               <--- result or ValueError ----------
    RequestStream <-- one call_soon_threadsafe ----   engine.step() -> outputs of every request
                      per step
    stream.close() -- abort command -------------->   engine.abort_request: blocks freed at once

Only the engine thread touches LLMEngine (it is not thread-safe); prompts arrive tokenized (the
server renders and tokenizes them on a thread of its own, AsyncTokenizer), and are checked once,
by the engine's InputProcessor (which reads only start-up facts) on the event loop, so only
bookkeeping runs on the engine thread per request.

Failures: a request that fails alone (its sampling or detokenization raised) gets
RequestFailedError on its stream and the others go on. Anything else raised by a step, or a
tensor-parallel rank that dies (even while idle), leaves the engine's state unknown: the loop
stops, every stream gets EngineUnavailableError, and the fatal callback tells the server to exit
non-zero so a supervisor restarts it. The server builds the engine
on that thread as well (`launch`), so every torch op of the process runs on one thread: with
PyTorch's OpenMP pool, parallel ops run markedly slower on a thread started after another thread
had made its own pool (docs/benchmarks.md, issue 4). Outputs are cumulative, so a
stream keeps only the latest output per choice: a slow client skips steps instead of queueing them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm import limits
from pagedllm.engine.input_processor import EngineRequest, InputProcessor, PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.outputs import INVALID_REQUEST, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.compile_pool import (
    CompilerUnavailableError,
    GrammarCompilePool,
    PoolClosedError,
)

if TYPE_CHECKING:
    from pathlib import Path

    import xgrammar
    from transformers import PreTrainedTokenizerBase

    from pagedllm.config import EngineConfig
    from pagedllm.core.block_pool import BlockPool
    from pagedllm.metrics.divergence import DivergenceGroup
    from pagedllm.model.config import ModelConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
StepCallback = Callable[[SchedulerStats, list[RequestOutput]], None]
"""Called on the engine thread after each loop turn with the stats and the outputs (aborts included)."""


class QueueFullError(Exception):
    """The waiting queue would go over --max-queue-len; the client should retry later."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or has died; no request can be served."""


class RequestFailedError(Exception):
    """This request failed inside the engine (the engine itself went on serving the others)."""


class RequestRejectedError(RequestFailedError):
    """This request failed inside the engine because of what it asked for (the client's fault)."""


class RequestStream:
    """The choices of one API request, as they grow: `async for updates in stream` yields
    {choice index: latest cumulative RequestOutput} until every choice has finished.

    Lives on the event loop. `close()` must be called when the handler is done (a finally):
    it aborts the choices still running, e.g. when the client went away.
    """

    def __init__(self, owner: AsyncLLM, req_ids: list[str]) -> None:
        self.req_ids = req_ids
        self._owner = owner
        self._latest: dict[int, RequestOutput] = {}
        self._event = asyncio.Event()
        self._unfinished = set(range(len(req_ids)))
        self._error: BaseException | None = None

    def _put(self, index: int, output: RequestOutput) -> None:
        self._latest[index] = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> dict[int, RequestOutput]:
        while not self._latest:
            if not self._unfinished:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()
        updates, self._latest = self._latest, {}
        for index, output in updates.items():
            if output.finished:
                self._unfinished.discard(index)
        return updates

    async def collect(self) -> list[RequestOutput]:
        """Wait for every choice to finish; their final outputs in choice order."""
        final: dict[int, RequestOutput] = {}
        async for updates in self:
            final.update(updates)
        return [final[i] for i in range(len(self.req_ids))]

    def close(self) -> None:
        if self._unfinished:
            self._owner.abort([self.req_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()


class AsyncLLM:
    """LLMEngine for an asyncio server. `start()` from the event loop, `shutdown()` at exit."""

    def __init__(self, engine: LLMEngine, *, max_queue_len: int | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.is_accepting = True
        self.error: BaseException | None = None
        self._on_step: StepCallback | None = None  # set_step_callback()
        self._on_fatal: Callable[[BaseException], None] | None = None  # set_fatal_callback()
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()  # None: stop
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # event loop only
        self._pending_outputs: list[RequestOutput] = []  # engine thread only: outputs of aborts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._submit_lock = threading.Lock()
        self._is_stopped = False
        self._grammar_pool: GrammarCompilePool | None = None  # at the first structured request

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- what the server reads ---------------------------------------------------------------
    # Model facts and the config are fixed once the engine is built: any thread reads them. The
    # block pool and block tables change with every step: only the engine thread reads them.

    @property
    def config(self) -> EngineConfig:
        """The engine's config, max_model_len resolved."""
        return self.engine.config

    @property
    def model_name(self) -> str:
        """The model's display name, e.g. SmolLM2-135M-Instruct."""
        return self.engine.model_name

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def tokenizer_folder(self) -> Path:
        return self.engine.tokenizer_folder

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.load_tokenizer()

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.kv_cache_plan.num_blocks

    async def divergence_report(self) -> list[DivergenceGroup] | None:
        """Where prompts stop sharing a prefix (GET /stats); None without the divergence finder.
        Runs on a worker thread (the finder has its own lock): analysing new prompts holds up
        neither the event loop nor a step."""
        divergence = self.engine.divergence
        if divergence is None:
            return None
        return await asyncio.to_thread(divergence.report)

    async def read_block_pool(self, fn: Callable[[BlockPool], T]) -> T:
        """`fn(block pool)` on the engine thread, between two steps (the dashboard's block map)."""
        return await self.call(lambda engine: fn(engine.kv_cache_manager.block_pool))

    async def read_block_tables(
        self, fn: Callable[[BlockPool, list[tuple[str, str | None, list[int]]]], T]
    ) -> T:
        """`fn(block pool, LLMEngine.block_tables())` on the engine thread, between two steps."""
        return await self.call(lambda engine: fn(engine.kv_cache_manager.block_pool, engine.block_tables()))

    @classmethod
    def launch(cls, make_engine: Callable[[], LLMEngine], **kwargs: Any) -> AsyncLLM:
        """Build the engine on a new engine thread, which then runs the engine loop; returns once
        the engine is built (raising what building raised). `start()` still attaches the loop."""
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        async_llm = cls(None, **kwargs)  # type: ignore[arg-type]  # built below, before any use

        def build_then_run() -> None:
            try:
                async_llm.engine = make_engine()
            except BaseException as error:
                built.set_exception(error)
                return
            built.set_result(async_llm.engine)
            async_llm._run()

        async_llm._thread = threading.Thread(target=build_then_run, name="pagedllm-engine", daemon=True)
        async_llm._thread.start()
        built.result()
        return async_llm

    def set_step_callback(self, on_step: StepCallback) -> None:
        """Called on the engine thread after each loop turn; set before serving starts. What it
        raises is logged, never fatal: it only reports."""
        self._on_step = on_step

    def set_fatal_callback(self, on_fatal: Callable[[BaseException], None]) -> None:
        """Called once, on the engine thread, if the engine loop dies; set before serving starts."""
        self._on_fatal = on_fatal

    def start(self) -> None:
        """Attach the running event loop; start the engine thread unless `launch` did."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def stop_admitting(self) -> None:
        """New requests get EngineUnavailableError from now on; running ones go on."""
        self.is_accepting = False

    async def shutdown(self) -> None:
        """Stop the engine thread after the commands already queued (aborts among them)."""
        self.stop_admitting()
        if self._grammar_pool is not None:
            self._grammar_pool.close()  # kills the compile processes: nothing to wait for
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)

    # ---- event loop side ---------------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        *,
        request_id: str,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        user: str | None = None,
    ) -> RequestStream:
        """Queue `params.n` sequences per prompt (choice i*n + j: prompt i, seed + j) as one
        atomic add: all are queued or none. Raises ValueError for a bad request,
        QueueFullError past --max-queue-len, EngineUnavailableError when not serving."""
        self._check_available()
        self._check_counts(prompts, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        processor = self._input_processor()
        processed = [
            processor.process(
                request_id, prompt, params, arrival_time=arrival, cache_salt=cache_salt, user=user
            )
            for prompt in prompts
        ]
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self._compile_grammar(params.structured_outputs, client=user)
        children = params.per_sequence()  # choice i*n + j: prompt i, children[j]
        requests = [
            dataclasses.replace(
                request, req_id=f"{request_id}-{i * params.n + j}", sampling_params=child, grammar=grammar
            )
            for i, request in enumerate(processed)
            for j, child in enumerate(children)
        ]
        req_ids = [request.req_id for request in requests]
        stream = RequestStream(self, req_ids)
        # Routes exist before the add is sent, so the first outputs always find their stream.
        for index, req_id in enumerate(req_ids):
            self._routes[req_id] = (stream, index)
        try:
            await self.call(lambda engine: self._add(engine, requests))
        except asyncio.CancelledError:
            self.abort(req_ids)  # the add may have gone through before the handler was cancelled
            raise
        except BaseException:
            for req_id in req_ids:
                self._routes.pop(req_id, None)
            raise
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread (between steps) and return its result."""
        self._check_available()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self._submit(_Command(fn, future)):
            raise EngineUnavailableError("the engine has stopped")
        return await asyncio.wrap_future(future)

    def abort(self, req_ids: list[str]) -> None:
        """Drop these requests now; the engine thread frees their blocks before its next step."""
        for req_id in req_ids:
            self._routes.pop(req_id, None)
        self._submit(_Command(lambda engine: self._pending_outputs.extend(engine.abort_request(req_ids))))

    def _submit(self, command: _Command) -> bool:
        """Queue work for the engine thread; False once the thread has stopped and nothing would run it."""
        with self._submit_lock:
            if not self._is_stopped:
                self._commands.put(command)
            return not self._is_stopped

    def _input_processor(self) -> InputProcessor:
        """The engine's front door: set at its construction and read-only after, so safe here."""
        return self.engine.input_processor

    def _check_counts(self, prompts: Sequence[PromptType], params: SamplingParams) -> None:
        """The fan-out's size, before any prompt is processed."""
        num_choices = len(prompts) * params.n
        if num_choices > limits.MAX_CHOICES:
            raise ValueError(
                f"n: {num_choices:,} sequences (prompts x n) is over the limit of {limits.MAX_CHOICES:,}"
            )
        if self.max_queue_len is not None and num_choices > self.max_queue_len:
            raise ValueError(
                f"n: {num_choices} sequences (prompts x n) can never fit --max-queue-len {self.max_queue_len}"
            )

    async def _compile_grammar(
        self, params: StructuredOutputsParams, *, client: str | None
    ) -> xgrammar.CompiledGrammar:
        """Compile a request's grammar in a compile process (a slow one holds up no step, no
        tokenization and no other request's compile: GrammarCompilePool; `client`, the request's
        `user`, gets its fair share of the processes). ValueError if it is invalid or too slow;
        EngineUnavailableError if shutdown cuts it or no compile process can be had (a 503)."""
        if self._grammar_pool is None:
            self._grammar_pool = GrammarCompilePool(
                self._input_processor().structured_output,
                num_workers=limits.GRAMMAR_COMPILE_WORKERS,
                timeout_s=limits.GRAMMAR_COMPILE_TIMEOUT_S,
            )
        try:
            return await self._grammar_pool.compile(params, client)
        except CompilerUnavailableError as error:
            raise EngineUnavailableError(str(error)) from None
        except PoolClosedError:
            raise EngineUnavailableError("the server is shutting down") from None
        except asyncio.CancelledError:
            if self.is_accepting:
                raise
            # cut by the shutdown's timeout: answered as a 503 like any request the shutdown refuses
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise EngineUnavailableError("the server is shutting down") from None

    def _check_available(self) -> None:
        if self.error is not None:
            raise EngineUnavailableError(f"the engine has stopped after an error: {self.error}")
        if not self.is_accepting:
            raise EngineUnavailableError("the server is shutting down")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted by its handler
            if output.error is not None and output.error.startswith(INVALID_REQUEST):
                route[0]._fail(RequestRejectedError(output.error.removeprefix(INVALID_REQUEST)))
            elif output.error is not None:
                route[0]._fail(RequestFailedError(f"the request failed: {output.error}"))
            else:
                route[0]._put(route[1], output)
            if output.finished:
                del self._routes[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream, _ in self._routes.values():
            stream._fail(EngineUnavailableError(f"the engine has stopped after an error: {error}"))
        self._routes.clear()

    # ---- engine thread -----------------------------------------------------------------------

    def _add(self, engine: LLMEngine, requests: list[EngineRequest]) -> None:
        """All or none of a fan-out's requests, already processed: bookkeeping only."""
        if self.max_queue_len is not None:
            waiting = engine.get_stats().num_waiting_reqs
            if waiting + len(requests) > self.max_queue_len:
                raise QueueFullError(
                    f"{waiting} requests are waiting and {len(requests)} more would pass --max-queue-len "
                    f"{self.max_queue_len}; retry later"
                )
        added: list[str] = []
        try:
            for request in requests:
                added.append(engine.add_processed(request))
        except BaseException:
            engine.abort_request(added)
            raise

    def _rank_died(self, error: BaseException) -> None:
        """A tensor-parallel rank died (called on the monitor's thread): the engine thread raises
        `error` at its next turn, idle or not, and so stops as after any fatal error."""

        def fail(engine: LLMEngine) -> None:
            raise error

        self._submit(_Command(fail))

    def _run(self) -> None:
        try:
            self.engine.set_failure_callback(self._rank_died)
            while self._run_commands(block=not self.engine.has_unfinished_requests()):
                outputs, self._pending_outputs = self._pending_outputs, []
                if self.engine.has_unfinished_requests():
                    outputs += self.engine.step()
                self._report(outputs)  # first: a client that has its answer finds it counted
                if outputs and self._loop is not None:  # outputs need requests, which need the loop
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
            self._close_engine()
        except BaseException as error:
            logger.exception("The engine loop failed; the server can no longer generate")
            self.error = error
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, error)
            if self._on_fatal is not None:
                self._on_fatal(error)
        finally:
            # Nothing queued from now on will run: answer the callers instead of leaving them waiting.
            with self._submit_lock:
                self._is_stopped = True
                while not self._commands.empty():
                    command = self._commands.get_nowait()
                    if command is not None and command.future is not None:
                        command.future.set_exception(EngineUnavailableError("the engine has stopped"))

    def _close_engine(self) -> None:
        """A graceful stop: the engine writes what it keeps across restarts (the disk tier)."""
        try:
            self.engine.close()
        except Exception:
            logger.exception("Closing the engine failed; what it keeps across restarts may be incomplete")

    def _report(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(self.engine.get_stats(), outputs)
        except Exception:
            logger.exception("Recording this step's statistics failed; serving goes on")

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when idle). False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            command.run(self.engine)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False


@dataclasses.dataclass
class _Command:
    """Work for the engine thread; with a future when someone awaits its result."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future | None = None

    def run(self, engine: LLMEngine) -> None:
        if self.future is None:
            self.fn(engine)
        elif self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn(engine))
            except Exception as error:
                self.future.set_exception(error)
