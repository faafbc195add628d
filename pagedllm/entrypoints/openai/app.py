"""The server's FastAPI app: the engine, the handlers and three routers, behind the middleware.

    request -> http_* metrics -> body size limit (413) -> API key (401) -> router
        routes_v1.py        /v1/models, /v1/completions, /v1/chat/completions -> serving_*.py
        routes_tokenize.py  /tokenize, /detokenize
        routes_stats.py     /health, /version, /metrics, /stats, /stats/kv_blocks, /dashboard
    /static                 the dashboard's chart library

The app's lifespan attaches the engine to the event loop and, at exit, stops the engine thread
and the tokenizer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.entrypoints.openai import routes_lora, routes_stats, routes_tokenize, routes_v1
from pagedllm.entrypoints.openai.errors import install_error_handlers
from pagedllm.entrypoints.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_completion import ServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import ServingEmbedding
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.entrypoints.openai.serving_score import ServingScore
from pagedllm.entrypoints.openai.serving_tokenization import ServingTokenization
from pagedllm.metrics.http import instrument_http
from pagedllm.metrics.live_stats import LiveStats
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.rerank_prompt import yes_no_tokens
from pagedllm.version import __version__


def build_app(
    engine: AsyncLLM,
    tokenizer: AsyncTokenizer,
    models: ServedModels,
    metrics: PrometheusMetrics,
    live_stats: LiveStats,
    server: ServerConfig,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()
        tokenizer.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if server.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server.max_request_body_bytes)
    instrument_http(app, metrics.registry)  # outermost: counts the 401s and 413s too
    completions = ServingCompletion(engine, models, tokenizer)
    chat = ServingChat(
        engine,
        models,
        tokenizer,
        trust_request_chat_template=server.trust_request_chat_template,
        tool_call_parser=server.tool_parser,
        truncate_history=server.truncate_chat_history,
    )
    embeddings = ServingEmbedding(engine, models, tokenizer, engine.facts.model_config.hidden_size)
    scores = ServingScore(engine, models, tokenizer, yes_no_tokens(tokenizer.tokenizer))
    tokenization = ServingTokenization(models, tokenizer, chat, engine.facts.vocab_size)
    v1 = routes_v1.make_router(models, completions, chat, embeddings, scores, metrics, server.serves)
    app.include_router(v1)
    if models.lora_checker is not None and server.allow_runtime_lora_updating:
        app.include_router(routes_lora.make_router(models))
    app.include_router(routes_tokenize.make_router(tokenization))
    app.include_router(
        routes_stats.make_router(engine, metrics, live_stats, divergence_text=server.divergence_text)
    )
    app.mount("/static", StaticFiles(directory=routes_stats.STATIC_DIR), name="static")
    return app
