"""POST /rerank and /score: how well each document answers a query, by a reranker that answers
"yes" or "no" (Qwen3-Reranker's format): each (query, document) pair becomes one prompt, the
engine runs it as a prefill with no decode, and the score is P("yes") over "yes" and "no" at the
prompt's last position (pooling_params.py's score_tokens), computed in the same steps as any
other request."""

from __future__ import annotations

import time
import uuid

from fastapi import Request, Response

from pagedllm import limits
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.entrypoints.openai.protocol import (
    EmbeddingUsage,
    RerankDocumentText,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_common import check_prompt_chars, collect_until_disconnected
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.pooling_params import PoolingParams
from pagedllm.rerank_prompt import reranker_prompt, score_pairs
from pagedllm.sampling_params import SamplingParams


class ServingScore:
    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        tokenizer: AsyncTokenizer,
        score_tokens: tuple[int, int] | None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.score_tokens = score_tokens

    async def rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        model = self.models.resolve(request.model)
        documents = [d if isinstance(d, str) else d.text for d in request.documents]
        if request.top_n is not None and request.top_n < 1:
            raise ValueError("top_n: must be >= 1")
        pairs = [(request.query, d) for d in documents]
        scored = await self._scores(pairs, request.instruction, request.user, model, raw_request)
        if scored is None:
            return Response(status_code=499)  # the client has gone
        scores, num_tokens = scored
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: request.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocumentText(text=documents[i]) if request.return_documents else None,
            )
            for i in order
        ]
        response = RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=model,
            usage=RerankUsage(total_tokens=num_tokens),
            results=results,
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def score(self, request: ScoreRequest, raw_request: Request) -> Response:
        model = self.models.resolve(request.model)
        pairs = score_pairs(request.text_1, request.text_2)
        scored = await self._scores(pairs, request.instruction, request.user, model, raw_request)
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        response = ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def _scores(
        self,
        pairs: list[tuple[str, str]],
        instruction: str | None,
        user: str | None,
        model: str,
        raw_request: Request,
    ) -> tuple[list[float], int] | None:
        """Each pair's P("yes") under `model` (the base's name or an adapter's), and the prompt
        tokens they took; None if the client left."""
        if self.score_tokens is None:
            raise ValueError("model: its vocabulary has no single 'yes' and 'no' tokens to score with")
        if not pairs:
            raise ValueError("documents: the list is empty")
        if len(pairs) > limits.MAX_CHOICES:
            raise ValueError(f"documents: {len(pairs):,} is over the limit of {limits.MAX_CHOICES:,}")
        texts = [reranker_prompt(query, document, instruction) for query, document in pairs]
        for text in texts:
            check_prompt_chars(
                "documents", len(text), self.models.max_model_len, self.tokenizer.max_chars_per_token
            )
        token_ids = await self.tokenizer.encode(texts, add_special_tokens=False)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, pooling=PoolingParams(score_tokens=self.score_tokens)
        )
        stream = await self.engine.generate(
            [{"prompt_token_ids": ids} for ids in token_ids],
            params,
            request_id=f"score-{uuid.uuid4().hex}",
            user=user,
            lora_request=self.models.lora_request(model),
        )
        outputs = await collect_until_disconnected(raw_request, stream)
        if outputs is None:
            return None
        scores = []
        for output in outputs:
            assert output.embedding is not None  # a failed request raised in collect
            scores.append(output.embedding[0])
        return scores, sum(len(ids) for ids in token_ids)
