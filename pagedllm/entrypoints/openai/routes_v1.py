"""The OpenAI routes: GET /v1/models, POST /v1/completions, /v1/chat/completions and
/v1/embeddings; and the reranking routes vLLM serves beside them: /rerank (also /v1/rerank and
/v2/rerank) and /score. --runner generate leaves the last four out, --runner pooling the first
two (as vLLM registers them: a 404 for the others). The handlers live in serving_*.py; here each
request's admission is counted as vLLM counts it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response

from pagedllm.engine.errors import QueueFullError
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
    runner: str = "auto",
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

    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt  # one text or one list of token ids, else a list of them
        num_prompts = (
            1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)
        )
        return await admitted(completions.create(body, request), body.n, body.max_tokens, num_prompts)

    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await admitted(chat.create(body, request), body.n, max_tokens)

    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        one = isinstance(body.input, str) or (body.input and isinstance(body.input[0], int))
        return await admitted(embeddings.create(body, request), 1, 1, 1 if one else len(body.input))

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await admitted(scores.rerank(body, request), 1, 1, len(body.documents))

    async def score(body: ScoreRequest, request: Request) -> Response:
        num_pairs = len(body.text_2) if isinstance(body.text_2, list) else 1
        return await admitted(scores.score(body, request), 1, 1, num_pairs)

    routes: dict[str, Callable[..., Awaitable[Response]]] = {}
    if runner in ("auto", "generate"):
        routes |= {"/v1/completions": create_completion, "/v1/chat/completions": create_chat_completion}
    if runner in ("auto", "pooling"):
        routes |= {"/v1/embeddings": create_embedding, "/score": score}
        routes |= dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), rerank)
    for path, handler in routes.items():
        router.add_api_route(path, handler, methods=["POST"])
    return router
