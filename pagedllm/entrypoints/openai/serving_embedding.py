"""POST /v1/embeddings (OpenAI's shape): each input's embedding, computed by the engine as a
prefill with no decode (pooling_params.py), batched with whatever else it is running."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import Request, Response

from pagedllm import limits
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedllm.entrypoints.openai.serving_common import collect_until_disconnected, tokenized_texts
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class ServingEmbedding:
    def __init__(
        self, engine: AsyncLLM, models: ServedModels, tokenizer: AsyncTokenizer, hidden_size: int
    ) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.hidden_size = hidden_size

    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        model = self.models.resolve(request.model)
        if request.dimensions is not None and not 1 <= request.dimensions <= self.hidden_size:
            raise ValueError(f"dimensions: must be in [1, {self.hidden_size}] for this model")
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            pooling=PoolingParams(dimensions=request.dimensions),
        )
        prompts = await self._prompts(request.input, truncated=request.truncate_prompt_tokens is not None)
        stream = await self.engine.generate(
            prompts,
            params,
            request_id=f"embd-{uuid.uuid4().hex}",
            arrival_time=arrival_time,
            user=request.user,
            lora_request=self.models.lora_request(model),
        )
        outputs = await collect_until_disconnected(raw_request, stream)
        if outputs is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        data = []
        for index, output in enumerate(outputs):
            assert output.embedding is not None  # a failed request raised in collect
            vector = output.embedding
            encoded = vector if request.encoding_format == "float" else _base64(vector)
            data.append(EmbeddingData(index=index, embedding=encoded))
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return Response(
            EmbeddingResponse(
                data=data,
                model=model,
                usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            ).model_dump_json(),
            media_type="application/json",
        )

    async def _prompts(
        self, inputs: str | list[str] | list[int] | list[list[int]], *, truncated: bool
    ) -> list[PromptType]:
        """Token ids of every input (text tokenized on the tokenizer's thread, after a size bound
        unless truncate_prompt_tokens will cut it); an empty input is refused, as OpenAI does."""
        items = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else inputs
        if not items:
            raise ValueError("input: the input list is empty")
        if len(items) > limits.MAX_CHOICES:
            raise ValueError(f"input: {len(items):,} inputs is over the limit of {limits.MAX_CHOICES:,}")
        for index, item in enumerate(items):
            if not item:
                raise ValueError(f"input[{index}]: an empty input has no embedding")
        if not isinstance(items[0], str):
            return [{"prompt_token_ids": ids} for ids in items]
        texts: list[str] = list(items)  # type: ignore[arg-type]
        return await tokenized_texts(
            "input", texts, self.tokenizer, self.models.max_model_len, truncated=truncated
        )


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values' little-endian bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
