"""POST /v1/chat/completions: messages through the tokenizer's chat template, n choices, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM, RequestStream
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from pagedllm.entrypoints.openai.serving_common import (
    DeltaTracker,
    choice_usage,
    collect_until_disconnected,
    event_stream,
    refuse_unsupported,
    sampling_params,
    sse,
    top_logprobs,
    usage,
)
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.outputs import RequestOutput


class ServingChat:
    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        tokenizer: AsyncTokenizer,
        *,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.trust_request_chat_template = trust_request_chat_template

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        model = self.models.resolve(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        params = sampling_params(request, max_tokens=max_tokens, logprobs=num_top)
        refuse_unsupported(
            request,
            {
                "tools": bool(request.tools) or bool(request.functions),
                "tool_choice": request.tool_choice not in (None, "none"),
            },
        )
        prompt = await self.prompt(
            request.messages,
            request.add_generation_prompt,
            request.chat_template,
            request.chat_template_kwargs,
        )
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.engine.generate(
            [prompt],
            params,
            request_id=response_id,
            arrival_time=arrival_time,
            cache_salt=request.cache_salt,
            user=request.user,
        )
        if request.stream:
            return StreamingResponse(
                self._stream(request, stream, response_id, model, params.n, num_top),
                media_type="text/event-stream",
            )
        outputs = await collect_until_disconnected(raw_request, stream)
        if outputs is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = [
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=output.outputs[0].text),
                logprobs=_logprobs(output, 0, len(output.outputs[0].token_ids), num_top),
                finish_reason=output.outputs[0].finish_reason,
                stop_reason=output.outputs[0].stop_reason,
            )
            for index, output in enumerate(outputs)
        ]
        return Response(
            ChatCompletionResponse(
                id=response_id, model=model, choices=choices, usage=usage(dict(enumerate(outputs)), params.n)
            ).model_dump_json(),
            media_type="application/json",
        )

    def _stream(
        self,
        request: ChatCompletionRequest,
        stream: RequestStream,
        response_id: str,
        model: str,
        n: int,
        num_top: int | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        continuous = options is not None and options.continuous_usage_stats
        tracker = DeltaTracker(len(stream.req_ids))
        latest: dict[int, RequestOutput] = {}

        def chunk(choice: ChatStreamChoice, output: RequestOutput | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=choice_usage(output) if continuous and output is not None else None,
                )
            )

        # Each choice opens with its role, before any token, as OpenAI's stream does.
        first = [
            chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            for i in range(len(stream.req_ids))
        ]

        def chunks(index: int, output: RequestOutput) -> Iterator[str]:
            latest[index] = output
            text, start, end = tracker.advance(index, output)
            completion = output.outputs[0]
            if not text and not completion.finished and (num_top is None or start == end):
                return
            choice = ChatStreamChoice(
                index=index,
                delta=DeltaMessage(content=text),
                logprobs=_logprobs(output, start, end, num_top),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            yield chunk(choice, output)

        def last() -> Iterator[str]:
            if options is not None and options.include_usage:
                yield sse(
                    ChatCompletionChunk(
                        id=response_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=usage(latest, n),
                    )
                )

        return event_stream(stream, first, chunks, last)

    async def prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The conversation rendered and tokenized, on the tokenizer's thread. A template sent by
        the client (chat_template, or chat_template_kwargs.chat_template) is code: it runs only
        with --trust-request-chat-template."""
        template_kwargs = dict(template_kwargs or {})
        if "chat_template" in template_kwargs:
            template = template_kwargs.pop("chat_template")
        if template is not None and not self.trust_request_chat_template:
            raise ValueError(
                "chat_template: this server does not run chat templates sent by clients "
                "(the operator can allow it with --trust-request-chat-template)"
            )
        if template is not None and not isinstance(template, str):
            raise ValueError("chat_template: must be a string")
        return await self.tokenizer.chat_prompt(
            _conversation(messages), add_generation_prompt, template=template, template_kwargs=template_kwargs
        )


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise ValueError("messages: at least one message is needed")
    conversation = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ValueError("messages: only text content parts are supported")
            content = "\n".join(part.text or "" for part in content)
        entry["content"] = content or ""
        conversation.append(entry)
    return conversation


def _logprobs(output: RequestOutput, start: int, end: int, num_top: int | None) -> ChatLogprobs | None:
    """OpenAI's chat logprobs of token positions [start, end)."""
    completion = output.outputs[0]
    if num_top is None or completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end], strict=True):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        content.append(
            TokenLogprob(
                token=token,
                logprob=sampled.logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode()),
                    )
                    for lp in top_logprobs(entry, num_top)
                ],
            )
        )
    return ChatLogprobs(content=content)
