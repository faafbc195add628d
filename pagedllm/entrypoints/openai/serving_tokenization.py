"""POST /tokenize and /detokenize (vLLM's shapes), run on the engine thread that owns the tokenizer."""

from __future__ import annotations

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import chat_prompt
from pagedllm.entrypoints.openai.serving_models import ServedModels


class ServingTokenization:
    def __init__(self, engine: AsyncLLM, models: ServedModels) -> None:
        self.engine = engine
        self.models = models

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.resolve(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        if request.messages is not None:
            build = chat_prompt(request.messages, request.add_generation_prompt, None)

            def run(engine: LLMEngine) -> list[int]:
                return build(engine.tokenizer)["prompt_token_ids"]  # type: ignore[index]

        else:
            text, add_special_tokens = request.prompt, request.add_special_tokens

            def run(engine: LLMEngine) -> list[int]:
                return engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

        tokens = await self.engine.call(run)
        return TokenizeResponse(count=len(tokens), max_model_len=self.models.max_model_len, tokens=tokens)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        tokens = request.tokens

        def run(engine: LLMEngine) -> str:
            vocab_size = engine.model_config.vocab_size
            if not all(0 <= token < vocab_size for token in tokens):
                raise ValueError(f"tokens: every id must be in [0, {vocab_size})")
            return engine.tokenizer.decode(tokens)

        return DetokenizeResponse(prompt=await self.engine.call(run))
