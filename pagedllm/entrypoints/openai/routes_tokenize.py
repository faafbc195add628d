"""POST /tokenize and /detokenize (vLLM's shapes); the work is serving_tokenization.py's."""

from __future__ import annotations

from fastapi import APIRouter

from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_tokenization import ServingTokenization


def make_router(tokenization: ServingTokenization) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    return router
