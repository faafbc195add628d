"""The OpenAI-compatible HTTP server: `pagedllm serve [MODEL]` or
`python -m pagedllm.entrypoints.openai.api_server --model MODEL`, one parser for both.

    uvicorn event loop: FastAPI routes -> serving_*.py -> AsyncLLM.generate -> RequestStream
    engine thread:      builds LLMEngine, then drives LLMEngine.step(); PrometheusMetrics and
                        LiveStats record after each turn (all torch work stays on this one thread)

Beside the OpenAI routes: /health, /version, /metrics (Prometheus), /stats (LiveStats' JSON),
/stats/kv_blocks (the KV block map, read on the engine thread) and /dashboard (a page that polls
both, with its chart library under /static).

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
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from http import HTTPStatus
from pathlib import Path
from types import FrameType
from typing import NoReturn

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import limits
from pagedllm.analysis.block_map import block_holders, block_map
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.async_engine import AsyncLLM, QueueFullError
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.errors import APIError, install_error_handlers
from pagedllm.entrypoints.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_completion import ServingCompletion
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.entrypoints.openai.serving_tokenization import ServingTokenization
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from pagedllm.logger import configure_logging
from pagedllm.metrics.http import instrument_http
from pagedllm.metrics.live_stats import LiveStats
from pagedllm.metrics.prometheus import PrometheusMetrics, caller_labels_on
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.outputs import RequestOutput
from pagedllm.tokenizer import load_tokenizer
from pagedllm.version import __version__
from pagedllm.worker.worker import resolve_device

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")  # by name: also run as __main__

API_KEY_ENV = "PAGEDLLM_API_KEY"
_DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_text()  # polls GET /stats
_STATIC_DIR = Path(__file__).parent / "static"  # the page's chart library (uPlot), no CDN


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags, then every engine flag (vLLM's names): the one parser of both entry points."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on. (default: 127.0.0.1)")
    group.add_argument(
        "--port", type=int, default=8000, help="Port to listen on; 0 picks a free one. (default: 8000)"
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) the API answers to; the first is echoed in responses. "
        "(default: the model's name, e.g. SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"Require `Authorization: Bearer KEY` on every /v1 call. (default: ${API_KEY_ENV}, else none)",
    )
    group.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="Most requests waiting for a seat in the batch; past it a request gets 503 with Retry-After. "
        "(default: no limit)",
    )
    group.add_argument(
        "--metrics-prefix",
        default="pagedllm",
        help="Prefix of the /metrics names; `vllm` gives vLLM's exact names for its dashboards. "
        "(default: pagedllm)",
    )
    group.add_argument(
        "--graceful-shutdown-timeout",
        type=int,
        default=30,
        help="Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted. "
        "(default: 30)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Largest request body; a larger one gets 413 before it is read. "
        f"(default: {limits.DEFAULT_MAX_REQUEST_BODY_BYTES:,})",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Run chat templates sent by clients (`chat_template`, `chat_template_kwargs.chat_template`). "
        "A template is code: allow it only for clients you trust. (default: refused with a 400)",
    )
    group.add_argument(
        "--chat-template-time-budget",
        type=float,
        default=5.0,
        help="Seconds a chat template may take to render; past it the request gets a 400. (default: 5)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='Serve tool_choice "auto": the model calls tools when it chooses, and --tool-call-parser '
        'reads the calls out of its text. "required" and a named function are always served '
        "(a grammar forces the call). (default: on)",
    )
    group.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_CALL_PARSERS),
        help="How tool calls are written in the model's output: hermes = <tool_call>{...}</tool_call> "
        "(Hermes, Qwen2.5, SmolLM2). (default: hermes)",
    )
    group.add_argument(
        "--metrics-caller-label",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Export prefix-cache hits by caller (the request's `user`, at most "
        f"{limits.MAX_USER_CHARS} characters, 100 names) on /metrics. Turn off when `user` holds "
        "personal data and /metrics is scraped from outside. (default: on without --api-key, off with it)",
    )
    group.add_argument(
        "--truncate-chat-history",
        action="store_true",
        help="A chat too long for max_model_len (after room for max_tokens) loses its oldest turns, "
        "never its system messages or its last message, instead of getting a 400; usage says how "
        "many messages and tokens went (dropped_messages, dropped_prompt_tokens). (default: off)",
    )
    group.add_argument(
        "--divergence-text",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Show the differing text where prompts stop sharing a prefix (GET /stats, /dashboard); "
        "it is your users' data: --no-divergence-text keeps offsets and counts only. (default: on)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level; info adds a line per HTTP request. (default: warning)",
    )
    add_engine_args(parser)
    return parser


def make_arg_parser() -> argparse.ArgumentParser:
    return add_server_args(
        argparse.ArgumentParser(
            allow_abbrev=False,
            prog="python -m pagedllm.entrypoints.openai.api_server",
            description="OpenAI-compatible server (same flags as `pagedllm serve`).",
        )
    )


def check_server_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_queue_len is not None and args.max_queue_len < 0:
        parser.error(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", args.metrics_prefix):
        parser.error(
            f"--metrics-prefix must be a Prometheus name like pagedllm or vllm, got {args.metrics_prefix!r}"
        )
    if args.graceful_shutdown_timeout < 0:
        parser.error("--graceful-shutdown-timeout must be >= 0")
    if args.max_request_body_bytes < 1:
        parser.error("--max-request-body-bytes must be >= 1")
    if args.chat_template_time_budget <= 0:
        parser.error("--chat-template-time-budget must be > 0")


# ---- the app ---------------------------------------------------------------------------------


def build_app(
    engine: AsyncLLM,
    tokenizer: AsyncTokenizer,
    models: ServedModels,
    metrics: PrometheusMetrics,
    live_stats: LiveStats,
    *,
    api_key: str | None = None,
    max_request_body_bytes: int = limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = "hermes",
    divergence_text: bool = True,
    truncate_chat_history: bool = False,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()
        tokenizer.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    instrument_http(app, metrics.registry)  # outermost: counts the 401s and 413s too
    completions = ServingCompletion(engine, models, tokenizer)
    chat = ServingChat(
        engine,
        models,
        tokenizer,
        trust_request_chat_template=trust_request_chat_template,
        tool_call_parser=tool_call_parser,
        truncate_history=truncate_chat_history,
    )
    tokenization = ServingTokenization(models, tokenizer, chat, engine.engine.model_config.vocab_size)

    async def admitted(
        create: Awaitable[Response], n: int, max_tokens: int | None, num_prompts: int = 1
    ) -> Response:
        """vLLM's admission metrics: a refusal past --max-queue-len, else the request's parameters."""
        try:
            response = await create
        except QueueFullError:
            metrics.record_rejection()
            raise
        metrics.record_request_params(n, max_tokens, num_prompts)
        return response

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.list()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt  # one text or one list of token ids, else a list of them
        num_prompts = (
            1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)
        )
        return await admitted(completions.create(body, request), body.n, body.max_tokens, num_prompts)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await admitted(chat.create(body, request), body.n, max_tokens)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running", type="server_error")
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    divergence = engine.engine.divergence

    @app.get("/stats")
    async def stats() -> dict:
        snapshot = live_stats.snapshot()
        if divergence is not None:  # the analysis of new prompts runs off the event loop
            groups = await asyncio.to_thread(divergence.report)
            snapshot["prefix_divergence"] = [
                g.as_dict(divergence_text, divergence.block_size) for g in groups
            ]
        return snapshot

    @app.get("/stats/kv_blocks")
    async def kv_block_map() -> dict:
        return await engine.call(lambda llm: block_map(llm.kv_cache_manager.block_pool))

    @app.get("/stats/kv_blocks/{block_id}")
    async def kv_block(block_id: int) -> dict:
        try:
            return await engine.call(
                lambda llm: block_holders(llm.kv_cache_manager.block_pool, llm.block_tables(), block_id)
            )
        except IndexError as error:
            raise APIError(HTTPStatus.NOT_FOUND, str(error)) from None

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_DASHBOARD_HTML)

    app.mount("/static", StaticFiles(directory=_STATIC_DIR), name="static")

    return app


# ---- running it ------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn with our shutdown: a signal stops admission at once, the drain keeps the port open
    (uvicorn's own shutdown closes it first, so late clients would get a refused connection
    instead of a 503 to retry elsewhere), and the process exits 0 (uvicorn itself re-raises the
    signal, exiting 130 or 143)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, url: str, settings: str) -> None:
        super().__init__(config)
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


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise SystemExit(
            f"error: cannot listen on {host}:{port}: {error.strerror}; pick another --port"
        ) from None
    return sock


def _exit_now(message: str, code: int) -> NoReturn:
    """Exit while the engine thread may be inside torch. A normal exit would finalize the
    interpreter under it: the thread is killed as it next takes the GIL, unwinding through C++
    frames that must not throw, and the process dies in `terminate called without an active
    exception` (SIGABRT). os._exit skips finalization; there is nothing left to save."""
    logger.warning(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _scheduler_settings(engine: LLMEngine) -> str:
    """What a vLLM user checks first: the scheduler's limits in effect."""
    config = engine.config
    prefix_caching = "on" if config.enable_prefix_caching else "off"
    return (
        f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
        f"max_model_len {engine.max_model_len}, prefix caching {prefix_caching}"
    )


def run_server(args: argparse.Namespace) -> None:
    """Load the engine and serve until SIGINT/SIGTERM."""
    configure_logging()
    try:
        config = engine_config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    sock = bind_socket(args.host, args.port)
    if "gpu_memory_utilization" in args and resolve_device(config.device).type != "cuda":
        logger.info(
            "--gpu-memory-utilization is for CUDA devices; on CPU the KV cache budget comes from "
            "--kv-cache-memory-bytes (default 4GiB)"
        )
    try:
        engine = AsyncLLM.launch(lambda: LLMEngine(config), max_queue_len=args.max_queue_len)
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        raise SystemExit(f"error: {error}") from None
    except KeyboardInterrupt:
        _exit_now("Interrupted while loading the model; exiting", 130)
    llm_engine = engine.engine
    tokenizer = AsyncTokenizer(
        load_tokenizer(llm_engine.tokenizer_folder, config.chat_template),
        template_time_budget=args.chat_template_time_budget,
    )
    models = ServedModels(
        args.served_model_name or [llm_engine.model_name],
        root=config.model or llm_engine.model_name,
        max_model_len=llm_engine.max_model_len,
    )
    metrics = PrometheusMetrics(
        models.names[0],
        prefix=args.metrics_prefix,
        max_model_len=llm_engine.max_model_len,
        cache_config={
            "block_size": str(llm_engine.config.block_size),
            "cache_dtype": llm_engine.config.kv_cache_dtype,
            "enable_prefix_caching": str(llm_engine.config.enable_prefix_caching),
            "num_gpu_blocks": str(llm_engine.kv_cache_plan.num_blocks),
        },
        caller_labels=caller_labels_on(args.metrics_caller_label, args.api_key),
    )
    live_stats = LiveStats(models.names[0], llm_engine.kv_cache_plan.num_blocks, llm_engine.config.block_size)

    def on_step(stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        metrics.record(stats, outputs)
        live_stats.record(stats, outputs)

    engine.set_step_callback(on_step)
    app = build_app(
        engine,
        tokenizer,
        models,
        metrics,
        live_stats,
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        divergence_text=args.divergence_text,
        truncate_chat_history=args.truncate_chat_history,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    uvicorn_config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    )
    server = _Server(uvicorn_config, engine, url, _scheduler_settings(llm_engine))
    engine.set_fatal_callback(server.engine_failed)
    server.run(sockets=[sock])
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
    run_server(args)


if __name__ == "__main__":
    main()
