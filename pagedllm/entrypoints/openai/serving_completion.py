"""POST /v1/completions: prompts (text or token ids, one or many) x n choices, whole or streamed;
with prompt_logprobs, each choice carries its prompt's (in a stream, its first chunk)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from pagedllm import limits
from pagedllm.engine.async_engine import AsyncLLM, RequestStream
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedllm.entrypoints.openai.serving_common import (
    DeltaTracker,
    choice_usage,
    collect_until_disconnected,
    event_stream,
    refuse_unsupported,
    sampling_params,
    sse,
    timings,
    tokenized_texts,
    top_logprobs,
    usage,
)
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.outputs import RequestOutput


class ServingCompletion:
    def __init__(self, engine: AsyncLLM, models: ServedModels, tokenizer: AsyncTokenizer) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        model = self.models.resolve(request.model)
        params = sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs)
        refuse_unsupported(
            request,
            {
                "best_of": request.best_of not in (None, params.n),
                "echo": request.echo,
                "suffix": bool(request.suffix),
            },
        )
        prompts = await self._prompts(request.prompt, truncated=params.truncate_prompt_tokens is not None)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.engine.generate(
            prompts,
            params,
            request_id=response_id,
            arrival_time=arrival_time,
            cache_salt=request.cache_salt,
            user=request.user,
            lora_request=self.models.lora_request(model),
        )
        if request.stream:
            return StreamingResponse(
                self._stream(request, stream, response_id, model, params.n), media_type="text/event-stream"
            )
        outputs = await collect_until_disconnected(raw_request, stream)
        if outputs is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = [
            CompletionChoice(
                index=index,
                text=output.outputs[0].text,
                logprobs=_logprobs(output, 0, len(output.outputs[0].token_ids), request.logprobs, 0),
                prompt_logprobs=output.prompt_logprobs,
                finish_reason=output.outputs[0].finish_reason,
                stop_reason=output.outputs[0].stop_reason,
            )
            for index, output in enumerate(outputs)
        ]
        return Response(
            CompletionResponse(
                id=response_id,
                model=model,
                choices=choices,
                usage=usage(dict(enumerate(outputs)), params.n),
                timings=timings(outputs[0]),
            ).model_dump_json(),
            media_type="application/json",
        )

    def _stream(
        self, request: CompletionRequest, stream: RequestStream, response_id: str, model: str, n: int
    ) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        continuous = options is not None and options.continuous_usage_stats
        tracker = DeltaTracker(len(stream.req_ids))
        latest: dict[int, RequestOutput] = {}
        prompt_logprobs_sent: set[int] = set()

        def chunks(index: int, output: RequestOutput) -> Iterator[str]:
            latest[index] = output
            offset = tracker.num_chars[index]
            text, start, end = tracker.advance(index, output)
            completion = output.outputs[0]
            # the prompt is whole once a token follows it
            prompt_logprobs = None
            if index not in prompt_logprobs_sent and (completion.token_ids or completion.finished):
                prompt_logprobs = output.prompt_logprobs
                prompt_logprobs_sent.add(index)
            if (
                not text
                and not completion.finished
                and prompt_logprobs is None
                and (request.logprobs is None or start == end)
            ):
                return
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=_logprobs(output, start, end, request.logprobs, offset),
                prompt_logprobs=prompt_logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            yield sse(
                CompletionResponse(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=choice_usage(output) if continuous else None,
                    timings=timings(output) if completion.finished else None,
                )
            )

        def last() -> Iterator[str]:
            if options is not None and options.include_usage:
                yield sse(
                    CompletionResponse(
                        id=response_id, created=created, model=model, choices=[], usage=usage(latest, n)
                    )
                )

        return event_stream(stream, (), chunks, last)

    async def _prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]], *, truncated: bool
    ) -> list[PromptType]:
        """Token ids of every prompt (text is tokenized on the tokenizer's thread, after a size
        bound unless truncate_prompt_tokens will cut it)."""
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not prompts:
            raise ValueError("prompt: the prompt list is empty")
        if isinstance(prompts[0], int):
            return [{"prompt_token_ids": prompts}]  # one prompt of token ids
        if len(prompts) > limits.MAX_CHOICES:
            raise ValueError(f"prompt: {len(prompts):,} prompts is over the limit of {limits.MAX_CHOICES:,}")
        if not isinstance(prompts[0], str):
            return [{"prompt_token_ids": ids} for ids in prompts]
        if not all(prompts):
            raise ValueError("prompt: the prompt is empty")
        return await tokenized_texts(
            "prompt", prompts, self.tokenizer, self.models.max_model_len, truncated=truncated
        )


def _logprobs(
    output: RequestOutput, start: int, end: int, num_top: int | None, text_offset: int
) -> CompletionLogprobs | None:
    """OpenAI's legacy logprobs of token positions [start, end)."""
    completion = output.outputs[0]
    if num_top is None or completion.logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end], strict=True):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append(
            {lp.decoded_token or "": lp.logprob for lp in top_logprobs(entry, num_top)}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result
