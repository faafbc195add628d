"""POST /tokenize and /detokenize (vLLM's shapes), on the tokenizer's thread (never the engine's)."""

from __future__ import annotations

from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_models import ServedModels


class ServingTokenization:
    def __init__(
        self, models: ServedModels, tokenizer: AsyncTokenizer, chat: ServingChat, vocab_size: int
    ) -> None:
        self.models = models
        self.tokenizer = tokenizer
        self.chat = chat
        self.vocab_size = vocab_size

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.resolve(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        if request.messages is not None:
            tokens = (await self.chat.prompt(request.messages, request.add_generation_prompt))[
                "prompt_token_ids"
            ]
        else:
            assert request.prompt is not None
            tokens = (await self.tokenizer.encode([request.prompt], request.add_special_tokens))[0]
        return TokenizeResponse(count=len(tokens), max_model_len=self.models.max_model_len, tokens=tokens)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        if not all(0 <= token < self.vocab_size for token in request.tokens):
            raise ValueError(f"tokens: every id must be in [0, {self.vocab_size})")
        return DetokenizeResponse(prompt=await self.tokenizer.decode(request.tokens))
