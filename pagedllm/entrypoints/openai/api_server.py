"""The OpenAI-compatible HTTP server's launch: `pagedllm serve [MODEL]` or
`python -m pagedllm.entrypoints.openai.api_server --model MODEL`, one parser for both
(server_config.py); the app and its routes are app.py's.

    uvicorn event loop: FastAPI routes -> serving_*.py -> AsyncLLM.generate -> RequestStream
    engine thread:      builds the EngineCore (AsyncLLM.build), then drives its step(); PrometheusMetrics and
                        LiveStats record after each turn (all torch work stays on this one thread)

Start-up: bind the port (fail fast), load the engine (it logs the KV cache report), then log the URL,
routes and scheduler settings. Ctrl-C during the load exits 130 at once.
SIGINT/SIGTERM: the port stays open and new requests get 503 with Retry-After while in-flight ones
get --graceful-shutdown-timeout seconds to finish (then they are aborted); the port closes, the
engine thread stops, a last line counts the drained and cut requests, and the process exits 0.
A second SIGINT cuts the drain short.
If the engine loop dies (an error that leaves its state unknown), /health answers 503, streams
get an error event, and the process exits 1 with the reason logged, for a supervisor to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

import uvicorn

from pagedllm.config import engine_config_from_args
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.listen_socket import bind_socket
from pagedllm.entrypoints.openai.server_config import (
    check_server_args,
    make_arg_parser,
    server_config_from_args,
    start_rank_forkserver,
)
from pagedllm.entrypoints.openai.serving_models import ServedModels, parse_lora_modules
from pagedllm.logger import configure_logging
from pagedllm.metrics.live_stats import LiveStats
from pagedllm.metrics.prometheus import PrometheusMetrics, caller_labels_on
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.outputs import RequestOutput
from pagedllm.worker.worker import resolve_device

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")  # by name: also run as __main__


class _Server(uvicorn.Server):
    """uvicorn with our shutdown: a signal stops admission at once, the drain keeps the port open
    (uvicorn's own shutdown closes it first, so late clients would get a refused connection
    instead of a 503 to retry elsewhere), and the process exits 0 (uvicorn itself re-raises the
    signal, exiting 130 or 143)."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncLLM, url: str, settings: str, early_signals: list[int]
    ) -> None:
        super().__init__(config)
        self.early_signals = early_signals
        """Signals that came after the engine was built, before serving took them over."""
        self.engine = engine
        self.url = url
        self.settings = settings
        self.exit_code = 0
        self.in_flight: set[asyncio.Task] = set()  # the HTTP requests running when the signal came
        self.num_cut = 0
        self._drain_deadline = 0.0

    def engine_failed(self, error: BaseException) -> None:
        """The engine loop died (called on its thread): stop serving and exit non-zero."""
        logger.error(
            "The engine failed (%s: %s); the server stops and exits with status 1 so that a "
            "supervisor can restart it",
            type(error).__name__,
            error,
        )
        self.exit_code = 1
        self.should_exit = True  # uvicorn's main loop polls this

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            timeout = self.config.timeout_graceful_shutdown or 0
            logger.info("Shutting down: new requests get 503; in-flight ones get %d s to finish", timeout)
            # Every request admitted so far is among these; later ones get 503 and are not waited for.
            self.in_flight = set(self.server_state.tasks)
            self._drain_deadline = time.monotonic() + timeout
        self.engine.stop_admitting()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._drain()
        await super().shutdown(sockets=sockets)

    async def _drain(self) -> None:
        """Wait, port open, for the requests in flight at the signal; past the deadline (or at a
        second SIGINT) cancel the rest, which aborts their engine requests."""
        while (
            not self.force_exit
            and any(not task.done() for task in self.in_flight)
            and time.monotonic() < self._drain_deadline
        ):
            await asyncio.sleep(0.1)
        cut = [task for task in self.in_flight if not task.done()]
        for task in cut:
            task.cancel(msg="cut: --graceful-shutdown-timeout exceeded")
        self.num_cut = len(cut)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in self.early_signals:
            self.handle_exit(sig, None)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            # Tests and scripts read the URL right after "Serving the OpenAI API on ".
            logger.info(
                "Serving the OpenAI API on %s (POST /v1/completions, /v1/chat/completions; "
                "GET /v1/models, /health, /metrics, /dashboard); %s",
                self.url,
                self.settings,
            )


def _exit_now(message: str, code: int) -> NoReturn:
    """Exit while the engine thread may be inside torch. A normal exit would finalize the
    interpreter under it: the thread is killed as it next takes the GIL, unwinding through C++
    frames that must not throw, and the process dies in `terminate called without an active
    exception` (SIGABRT). os._exit skips finalization; there is nothing left to save."""
    logger.warning(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _scheduler_settings(engine: AsyncLLM) -> str:
    """What a vLLM user checks first: the scheduler's limits in effect."""
    config = engine.config
    prefix_caching = "on" if config.enable_prefix_caching else "off"
    return (
        f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
        f"max_model_len {engine.facts.max_model_len}, prefix caching {prefix_caching}"
    )


def run_server(args: argparse.Namespace) -> None:
    """Load the engine and serve until SIGINT/SIGTERM."""
    configure_logging()
    try:
        config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    sock = bind_socket(server_config.host, server_config.port)
    if "gpu_memory_utilization" in args and resolve_device(config.device).type != "cuda":
        logger.info(
            "--gpu-memory-utilization is for CUDA devices; on CPU the KV cache budget comes from "
            "--kv-cache-memory-bytes (default 4GiB)"
        )
    try:
        engine = AsyncLLM.launch(lambda: AsyncLLM.build(config, max_queue_len=server_config.max_queue_len))
    except (ValueError, OSError, NotImplementedError) as error:  # ModelLoadError: a damaged file
        raise SystemExit(f"error: {error}") from None
    except KeyboardInterrupt:
        _exit_now("Interrupted while loading the model; exiting", 130)
    # Until serving takes the signals over, one is kept for it: the default handler would raise
    # anywhere in the set-up below, and asyncio's (installed where the default is) cancels a task
    # that uvicorn's start-up can swallow: a Ctrl-C lost, the server serving on.
    early_signals: list[int] = []
    handlers = {
        sig: signal.signal(sig, lambda received, _frame: early_signals.append(received))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    assert engine.source is not None  # AsyncLLM.build resolved it
    tokenizer = AsyncTokenizer(
        engine.source.load_tokenizer(config.chat_template),
        template_time_budget=server_config.chat_template_time_budget,
    )
    models = ServedModels(
        server_config.served_model_name or [engine.facts.model_name],
        root=config.model or engine.facts.model_name,
        max_model_len=engine.facts.max_model_len,
        lora_checker=engine.input_processor.lora_checker,
    )
    try:
        for module in parse_lora_modules(server_config.lora_modules):
            models.add_adapter(models.check_adapter(module))
    except (ValueError, APIError) as error:
        engine.core.shutdown()  # ranks 1.. must not wait for a step that never comes
        raise SystemExit(f"error: --lora-modules: {error}") from None
    spec = engine.config.speculation
    metrics = PrometheusMetrics(
        models.names[0],
        prefix=server_config.metrics_prefix,
        max_model_len=engine.facts.max_model_len,
        cache_config={
            "block_size": str(engine.config.block_size),
            "cache_dtype": engine.config.kv_cache_dtype,
            "enable_prefix_caching": str(engine.config.enable_prefix_caching),
            "num_gpu_blocks": str(engine.facts.num_kv_blocks),
        },
        caller_labels=caller_labels_on(server_config.metrics_caller_label, server_config.api_key),
        num_speculative_tokens=None if spec is None else spec.num_speculative_tokens,
        max_loras=engine.config.max_loras if engine.config.enable_lora else None,
    )
    live_stats = LiveStats(models.names[0], engine.facts.num_kv_blocks, engine.config.block_size)

    def on_step(stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        metrics.record(stats, outputs)
        live_stats.record(stats, outputs)

    engine.set_step_callback(on_step)
    app = build_app(engine, tokenizer, models, metrics, live_stats, server_config)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    uvicorn_config = uvicorn.Config(
        app,
        log_level=server_config.uvicorn_log_level,
        timeout_graceful_shutdown=server_config.graceful_shutdown_timeout,
    )
    server = _Server(uvicorn_config, engine, url, _scheduler_settings(engine), early_signals)
    engine.set_fatal_callback(server.engine_failed)
    server.run(sockets=[sock])
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    logger.info(
        "Server stopped: %d requests finished during the drain, %d cut",
        len(server.in_flight) - server.num_cut,
        server.num_cut,
    )
    if engine.is_healthy:  # a second SIGINT skipped the engine's shutdown: its thread still runs
        _exit_now("The engine thread was still running; exiting without waiting for it", 130)
    if server.exit_code:
        raise SystemExit(server.exit_code)


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    check_server_args(parser, args)
    start_rank_forkserver(args)
    run_server(args)


if __name__ == "__main__":
    main()
