"""The OpenAI routes: GET /v1/models, POST /v1/completions, /v1/chat/completions and
/v1/embeddings; and the reranking routes vLLM serves beside them: /rerank (also /v1/rerank and
/v2/rerank) and /score. The handlers live in serving_*.py; here each request's admission is counted
as vLLM counts it."""

from __future__ import annotations

from collections.abc import Awaitable

from fastapi import APIRouter, Request, Response

from pagedllm.engine.async_engine import QueueFullError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelList,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_completion import ServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import ServingEmbedding
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.entrypoints.openai.serving_score import ServingScore
from pagedllm.metrics.prometheus import PrometheusMetrics


def make_router(
    models: ServedModels,
    completions: ServingCompletion,
    chat: ServingChat,
    embeddings: ServingEmbedding,
    scores: ServingScore,
    metrics: PrometheusMetrics,
) -> APIRouter:
    router = APIRouter()

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

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        return models.list()

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt  # one text or one list of token ids, else a list of them
        num_prompts = (
            1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)
        )
        return await admitted(completions.create(body, request), body.n, body.max_tokens, num_prompts)

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await admitted(chat.create(body, request), body.n, max_tokens)

    @router.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        num_inputs = (
            1
            if isinstance(body.input, str) or (body.input and isinstance(body.input[0], int))
            else len(body.input)
        )
        return await admitted(embeddings.create(body, request), 1, 1, num_inputs)

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await admitted(scores.rerank(body, request), 1, 1, len(body.documents))

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])

    @router.post("/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        num_pairs = len(body.text_2) if isinstance(body.text_2, list) else 1
        return await admitted(scores.score(body, request), 1, 1, num_pairs)

    return router
