"""AsyncLLM: the server's front end, an EngineCore driven by one background thread.

    event loop (HTTP handlers)                        engine thread
    generate(): InputProcessor.process (vocabulary, lengths, limits), the grammar, then
            ------- add command (SimpleQueue) ---->   EngineCore.add_request(EngineRequest) and
               <--- result or ValueError ----------   OutputProcessor.add_request: bookkeeping
    RequestStream <-- one call_soon_threadsafe ----   EngineCore.step() -> OutputProcessor (text,
                      per step                        stop strings) -> outputs of every request
    stream.close() -- abort command -------------->   EngineCore.finish_requests: blocks freed at once

Only the engine thread touches the core (it is not thread-safe) and the OutputProcessor; prompts
arrive tokenized (the server renders and tokenizes them on a thread of its own, AsyncTokenizer),
and are checked once, by this front end's own InputProcessor (which reads only start-up facts) on
the event loop, so only bookkeeping runs on the engine thread per request. What the server needs
to know of the model comes from the core's ModelFacts, fixed once built.

Failures: a request that fails alone (its sampling or detokenization raised) gets
RequestFailedError on its stream and the others go on. Anything else raised by a step, or a
tensor-parallel rank that dies (even while idle), leaves the engine's state unknown: the loop
stops, every stream gets EngineUnavailableError, and the fatal callback tells the server to exit
non-zero so a supervisor restarts it. The server builds the core
on that thread as well (`launch`), so every torch op of the process runs on one thread: with
PyTorch's OpenMP pool, parallel ops run markedly slower on a thread started after another thread
had made its own pool (docs/benchmarks/throughput.md, issue 4). Outputs are cumulative, so a
stream keeps only the latest output per choice: a slow client skips steps instead of queueing them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm import limits
from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.errors import (
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
)
from pagedllm.engine.front_step import abort_outputs, add_to_core, step_outputs
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.messages import EngineRequest, ModelFacts
from pagedllm.engine.model_source import ModelSource
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request_stream import RequestStream
from pagedllm.engine.warm_up import warm_up
from pagedllm.lora.checker import lora_checker_for
from pagedllm.lora_request import LoRARequest
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.metrics.stats_logger import StatsLogger
from pagedllm.outputs import INVALID_REQUEST, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.compile_pool import (
    CompilerUnavailableError,
    GrammarCompilePool,
    PoolClosedError,
)

if TYPE_CHECKING:
    import xgrammar

    from pagedllm.core.block_pool import BlockPool
    from pagedllm.metrics.divergence import DivergenceGroup

logger = logging.getLogger(__name__)

T = TypeVar("T")
StepCallback = Callable[[SchedulerStats, list[RequestOutput]], None]
"""Called on the engine thread after each loop turn with the stats and the outputs (aborts included)."""


class AsyncLLM:
    """The server's front end: an EngineCore driven by one engine thread. `build` (on that thread)
    or the constructor, then `start()` from the event loop, `shutdown()` at exit.

    Owned by the event loop: the InputProcessor (reads start-up facts only), the routes, the
    grammar pool. Owned by the engine thread: the core, the OutputProcessor, the stats logger.
    Fixed once built, read by any thread: `config`, `facts`, `source`.
    """

    def __init__(
        self,
        core: EngineCore,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        *,
        source: ModelSource | None = None,
        max_queue_len: int | None = None,
    ) -> None:
        """`source`: where the model and its tokenizer came from (the server loads a tokenizer of
        its own from it); None for a core built some other way."""
        self.core = core
        self.config: EngineConfig = core.config
        """The config in effect, max_model_len resolved."""
        self.facts: ModelFacts = core.facts
        self.source = source
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.stats_logger = (
            None
            if self.config.disable_log_stats
            else StatsLogger(self.config.log_stats_interval, self.config.enable_prefix_caching)
        )
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

    @classmethod
    def build(cls, config: EngineConfig, *, max_queue_len: int | None = None) -> AsyncLLM:
        """Resolve the model, load the tokenizer, start the core, warm the prefix cache up
        (--prefix-cache-warmup): on the thread that will drive the core (`launch`). A failure
        after the core started stops its ranks."""
        source = ModelSource.resolve(config)
        tokenizer = source.load_tokenizer(config.chat_template)
        core = EngineCore(config, source, decode=tokenizer.decode)
        try:
            async_llm = cls(
                core,
                InputProcessor.for_model(
                    core.facts,
                    tokenizer,
                    core.config.max_logprobs,
                    lora_checker_for(core.config, core.facts.model_config),
                ),
                OutputProcessor(tokenizer, speculative=core.config.speculation is not None),
                source=source,
                max_queue_len=max_queue_len,
            )
            if core.config.prefix_cache_warmup:
                async_llm._warm_up(core.config.prefix_cache_warmup)
        except BaseException:
            core.shutdown()  # ranks 1.. must not wait for a step that never comes
            raise
        return async_llm

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    async def divergence_report(self) -> list[DivergenceGroup] | None:
        """Where prompts stop sharing a prefix (GET /stats); None without the divergence finder.
        Runs on a worker thread (the finder, fixed at the core's construction, has its own
        lock): analysing new prompts holds up neither the event loop nor a step."""
        divergence = self.core.divergence
        if divergence is None:
            return None
        return await asyncio.to_thread(divergence.report)

    async def read_block_pool(self, fn: Callable[[BlockPool], T]) -> T:
        """`fn(block pool)` on the engine thread, between two steps (the dashboard's block map)."""
        return await self.call(lambda core: fn(core.kv_cache_manager.block_pool))

    async def read_block_tables(
        self, fn: Callable[[BlockPool, list[tuple[str, str | None, list[int]]]], T]
    ) -> T:
        """`fn(block pool, EngineCore.block_tables())` on the engine thread, between two steps."""
        return await self.call(lambda core: fn(core.kv_cache_manager.block_pool, core.block_tables()))

    @classmethod
    def launch(cls, make: Callable[[], AsyncLLM]) -> AsyncLLM:
        """Build the front end and its core (`make`, e.g. `lambda: AsyncLLM.build(config)`) on a
        new engine thread, which then runs the engine loop; returns once it is built (raising
        what building raised). `start()` still attaches the loop."""
        built: concurrent.futures.Future[AsyncLLM] = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                async_llm = make()
            except BaseException as error:
                built.set_exception(error)
                return
            async_llm._thread = threading.current_thread()
            built.set_result(async_llm)
            async_llm._run()

        threading.Thread(target=build_then_run, name="pagedllm-engine", daemon=True).start()
        return built.result()

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
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue `params.n` sequences per prompt (choice i*n + j: prompt i, seed + j) as one
        atomic add: all are queued or none. Raises ValueError for a bad request,
        QueueFullError past --max-queue-len, EngineUnavailableError when not serving."""
        self._check_available()
        self._check_counts(prompts, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        processed = [
            self.input_processor.process(
                request_id,
                prompt,
                params,
                arrival_time=arrival,
                cache_salt=cache_salt,
                user=user,
                lora_request=lora_request,
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
        stream = RequestStream(self.abort, req_ids)
        # Routes exist before the add is sent, so the first outputs always find their stream.
        for index, req_id in enumerate(req_ids):
            self._routes[req_id] = (stream, index)
        try:
            await self.call(lambda core: self._add(requests))
        except asyncio.CancelledError:
            self.abort(req_ids)  # the add may have gone through before the handler was cancelled
            raise
        except BaseException:
            for req_id in req_ids:
                self._routes.pop(req_id, None)
            raise
        return stream

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` on the engine thread (between steps) and return its result."""
        self._check_available()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self._submit(_Command(fn, future)):
            raise EngineUnavailableError("the engine has stopped")
        return await asyncio.wrap_future(future)

    def abort(self, req_ids: list[str]) -> None:
        """Drop these requests now; the engine thread frees their blocks before its next step."""
        for req_id in req_ids:
            self._routes.pop(req_id, None)
        self._submit(_Command(lambda core: self._pending_outputs.extend(self._abort_now(req_ids))))

    def _submit(self, command: _Command) -> bool:
        """Queue work for the engine thread; False once the thread has stopped and nothing would run it."""
        with self._submit_lock:
            if not self._is_stopped:
                self._commands.put(command)
            return not self._is_stopped

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
                self.input_processor.structured_output,
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

    def _add(self, requests: list[EngineRequest]) -> None:
        """All or none of a fan-out's requests, already processed: bookkeeping only."""
        if self.max_queue_len is not None:
            waiting = self.core.get_stats().num_waiting_reqs
            if waiting + len(requests) > self.max_queue_len:
                raise QueueFullError(
                    f"{waiting} requests are waiting and {len(requests)} more would pass --max-queue-len "
                    f"{self.max_queue_len}; retry later"
                )
        added: list[str] = []
        try:
            for request in requests:
                self._add_one(request)
                added.append(request.req_id)
        except BaseException:
            self._abort_now(added)
            raise

    def _add_one(self, processed: EngineRequest) -> None:
        """The core's bookkeeping, then this front end's detokenizer for the request."""
        add_to_core(self.core, self.output_processor, processed)

    def _abort_now(self, req_ids: list[str]) -> list[RequestOutput]:
        return abort_outputs(self.core, self.output_processor, req_ids)

    def _step(self) -> list[RequestOutput]:
        """One core step, its token ids made text; what a stop string or a failed output ended
        goes back to the core in the same step, so its blocks are free for the next."""
        return step_outputs(self.core, self.output_processor, self.stats_logger)

    def _warm_up(self, path: str) -> None:
        """--prefix-cache-warmup, before serving (engine/warm_up.py); `build` calls it."""
        params = SamplingParams(max_tokens=1)
        ids = itertools.count()

        def add(prompt_ids: list[int]) -> None:
            self._add_one(
                self.input_processor.process(f"warm-up-{next(ids)}", {"prompt_token_ids": prompt_ids}, params)
            )

        def run_to_end() -> None:
            while self.core.has_unfinished_requests():
                self._step()

        warm_up(path, self.input_processor.tokenizer, add, run_to_end)

    def _rank_died(self, error: BaseException) -> None:
        """A tensor-parallel rank died (called on the monitor's thread): the engine thread raises
        `error` at its next turn, idle or not, and so stops as after any fatal error."""

        def fail(core: EngineCore) -> None:
            raise error

        self._submit(_Command(fail))

    def _run(self) -> None:
        try:
            self.core.set_failure_callback(self._rank_died)
            while self._run_commands(block=not self.core.has_unfinished_requests()):
                outputs, self._pending_outputs = self._pending_outputs, []
                if self.core.has_unfinished_requests():
                    outputs += self._step()
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
        """A graceful stop: the core writes what it keeps across restarts (the disk tier)."""
        try:
            self.core.close()
        except Exception:
            logger.exception("Closing the engine failed; what it keeps across restarts may be incomplete")

    def _report(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(self.core.get_stats(), outputs)
        except Exception:
            logger.exception("Recording this step's statistics failed; serving goes on")

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when idle). False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            command.run(self.core)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False


@dataclasses.dataclass
class _Command:
    """Work for the engine thread; with a future when someone awaits its result."""

    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future | None = None

    def run(self, core: EngineCore) -> None:
        if self.future is None:
            self.fn(core)
        elif self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn(core))
            except Exception as error:
                self.future.set_exception(error)
