"""The OpenAI-compatible HTTP server: `pagedllm serve [MODEL]` or
`python -m pagedllm.entrypoints.openai.api_server --model MODEL`, one parser for both.

    uvicorn event loop: FastAPI routes -> serving_*.py -> AsyncLLM.generate -> RequestStream
    engine thread:      builds LLMEngine, then drives LLMEngine.step(); PrometheusMetrics and
                        LiveStats record after each turn (all torch work stays on this one thread)

Beside the OpenAI routes: /health, /version, /metrics (Prometheus), /stats (LiveStats' JSON)
and /dashboard (a page that polls /stats).

Start-up: bind the port (fail fast), load the engine (it logs the KV cache report), then log the URL.
SIGINT/SIGTERM: new requests get 503, in-flight ones get --graceful-shutdown-timeout seconds to
finish and are then aborted, the engine thread stops, the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http import HTTPStatus
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.errors import APIError, error_response, install_error_handlers
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
from pagedllm.logger import configure_logging
from pagedllm.metrics.live_stats import LiveStats
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.outputs import RequestOutput
from pagedllm.worker.worker import resolve_device

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")  # by name: also run as __main__

API_KEY_ENV = "PAGEDLLM_API_KEY"
_DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_text()  # polls GET /stats


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


# ---- the app ---------------------------------------------------------------------------------


class APIKeyMiddleware:
    """401 for a /v1 or /stats call without `Authorization: Bearer <key>`, before the body is
    read. /stats names callers (their `user` strings), so it is guarded like the API."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/stats")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    HTTPStatus.UNAUTHORIZED,
                    "Missing or wrong API key: send `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLM,
    models: ServedModels,
    metrics: PrometheusMetrics,
    live_stats: LiveStats,
    *,
    api_key: str | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    completions = ServingCompletion(engine, models)
    chat = ServingChat(engine, models)
    tokenization = ServingTokenization(engine, models)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.list()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

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

    @app.get("/stats")
    async def stats() -> dict:
        return live_stats.snapshot()

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_DASHBOARD_HTML)

    return app


# ---- running it ------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn with our shutdown: a signal stops admission at once, and after the graceful
    shutdown the process exits 0 (uvicorn itself re-raises the signal, exiting 130 or 143)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, url: str) -> None:
        super().__init__(config)
        self.engine = engine
        self.url = url

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info(
                "Shutting down: new requests get 503; in-flight ones get %d s to finish",
                self.config.timeout_graceful_shutdown or 0,
            )
        self.engine.stop_admitting()
        super().handle_exit(sig, frame)

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
            logger.info("Serving the OpenAI API on %s (POST /v1/completions, /v1/chat/completions)", self.url)


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
    llm_engine = engine.engine
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
    )
    live_stats = LiveStats(models.names[0], llm_engine.kv_cache_plan.num_blocks, llm_engine.config.block_size)

    def on_step(stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        metrics.record(stats, outputs)
        live_stats.record(stats, outputs)

    engine.set_step_callback(on_step)
    app = build_app(engine, models, metrics, live_stats, api_key=args.api_key)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    uvicorn_config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    )
    _Server(uvicorn_config, engine, url).run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    check_server_args(parser, args)
    run_server(args)


if __name__ == "__main__":
    main()
