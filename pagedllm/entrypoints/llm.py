"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.logger import configure_logging
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.rerank_prompt import reranker_prompt, score_pairs, yes_no_tokens
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import chat_prompt, max_prompt_chars, max_token_chars

Conversation = list[dict[str, Any]]


class LLM:
    """Load a model and generate for a batch of prompts with continuous batching.

    Args are EngineConfig's fields (`dtype`, `max_model_len`, `block_size`, `max_num_seqs`,
    `max_num_batched_tokens`, `kv_cache_memory_bytes`, `enable_prefix_caching`, `seed`, ...).
    `model=None` loads the embedded SmolLM2-135M-Instruct.

    With tensor_parallel_size > 1 the engine holds this process's torch.distributed group and
    ranks 1..: `shutdown()` (or leaving `with LLM(...) as llm:`) lets them go, so that another
    LLM can start in the same process (a notebook, a test); an LLM that is garbage-collected
    lets them go too.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        configure_logging()
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()
        self._is_shut_down = False
        self._max_prompt_chars: int | None = None

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, free the process group, and write the disk tier
        (--kv-offload-dir). Idempotent; the LLM generates nothing after it."""
        if not self._is_shut_down:
            self._is_shut_down = True
            self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Only what must not leak: ranks and the group (the disk tier is written by shutdown();
        # here, at interpreter exit, the modules it needs may already be gone).
        if not getattr(self, "_is_shut_down", True):
            self._is_shut_down = True
            self.llm_engine.core.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.
        `lora_request`: the adapter all prompts run under, or one per prompt (None: the base
        model; needs enable_lora=True)."""
        batch = _as_batch(prompts)
        params = self._params_per_prompt(batch, sampling_params)
        return self._run(batch, params, use_tqdm, _per_prompt(batch, lora_request))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (pooling_params.py: its last token's final hidden state, normed,
        then PoolingParams' dimensions and normalization), in the prompts' order. A request that
        failed raises RuntimeError naming it."""
        batch = _as_batch(prompts)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling_params or PoolingParams())
        outputs = self._run(batch, [params] * len(batch), use_tqdm)
        embedded = []
        for output in outputs:
            if output.embedding is None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            vector = EmbeddingOutput(output.embedding)
            embedded.append(EmbeddingRequestOutput(output.request_id, output.prompt_token_ids, vector))
        return embedded

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        instruction: str | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """How well each text_2 answers text_1 (one query against each document, or pairwise), by
        a yes/no reranker (rerank_prompt.py: Qwen3-Reranker's prompt; the score is P("yes"))."""
        tokenizer = self.get_tokenizer()
        score_tokens = yes_no_tokens(tokenizer)
        if score_tokens is None:
            raise ValueError("this model's vocabulary has no single 'yes' and 'no' tokens to score with")
        texts = [reranker_prompt(q, d, instruction) for q, d in score_pairs(text_1, text_2)]
        prompts: list[PromptType] = [
            {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)} for text in texts
        ]
        pooling = PoolingParams(score_tokens=score_tokens)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        scored = []
        for output in outputs:
            if output.embedding is None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            score = ScoringOutput(output.embedding[0])
            scored.append(ScoringRequestOutput(output.request_id, output.prompt_token_ids, score))
        return scored

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. The template is
        untrusted input (it comes with the model): it renders within the server's default time
        budget and the characters a prompt of max_model_len can hold, else ValueError."""
        is_one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[Conversation], [messages] if is_one else list(messages))
        tokenizer = self.get_tokenizer()
        if self._max_prompt_chars is None:
            self._max_prompt_chars = max_prompt_chars(
                self.llm_engine.max_model_len, max_token_chars(tokenizer)
            )
        prompts: list[PromptType] = [
            chat_prompt(
                tokenizer,
                conversation,
                add_generation_prompt,
                template_kwargs=chat_template_kwargs,
                max_chars=self._max_prompt_chars,
            )
            for conversation in conversations
        ]
        params = self._params_per_prompt(prompts, sampling_params)
        return self._run(prompts, params, use_tqdm, _per_prompt(prompts, lora_request))

    def reset_prefix_cache(self) -> int:
        """Drop every cached-but-free block. Returns how many were dropped."""
        return self.llm_engine.reset_prefix_cache()

    def _params_per_prompt(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        return list(sampling_params)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        adapters: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # One engine request per sequence; n > 1 fans out with seeds seed, seed+1, ...
        owners: dict[str, tuple[int, int]] = {}
        try:
            for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                adapter = adapters[index] if adapters is not None else None
                for j, child in enumerate(p.per_sequence()):
                    req_id = engine.add_request(f"{next(self._ids)}", prompt, child, lora_request=adapter)
                    owners[req_id] = (index, j)
        except ValueError:
            engine.abort_request(list(owners))
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(owners), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        with logging_redirect_tqdm(loggers=[logging.getLogger("pagedllm")]):  # log lines above the bar
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in owners:
                        finished[output.request_id] = output
                        bar.update(1)
        bar.close()
        return _merge_by_prompt(finished, owners, len(prompts))


def _per_prompt(
    prompts: list[PromptType], lora_request: LoRARequest | Sequence[LoRARequest | None] | None
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * len(prompts)
    if len(lora_request) != len(prompts):
        raise ValueError(f"lora_request: {len(lora_request)} given for {len(prompts)} prompts")
    return list(lora_request)


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a text, a dict, a list of token ids) as a batch of one; a batch as a list."""
    is_one = isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    )
    return cast(list[PromptType], [prompts] if is_one else list(cast(Sequence[PromptType], prompts)))


def _merge_by_prompt(
    finished: dict[str, RequestOutput], owners: dict[str, tuple[int, int]], num_prompts: int
) -> list[RequestOutput]:
    merged: list[RequestOutput | None] = [None] * num_prompts
    for req_id, (index, j) in sorted(owners.items(), key=lambda item: item[1]):
        output = finished[req_id]
        completion = dataclasses.replace(output.outputs[0], index=j)
        if merged[index] is None:
            merged[index] = dataclasses.replace(output, outputs=[completion])
        else:
            merged[index].outputs.append(completion)  # type: ignore[union-attr]
    return [m for m in merged if m is not None]
