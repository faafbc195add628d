"""POST /v1/chat/completions: messages through the tokenizer's chat template, n choices, whole or
streamed; tools and tool calls as tools.py plans them."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM, RequestStream
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.entrypoints.openai.chat_history import HistoryCut, fit_history
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
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving_common import (
    DeltaTracker,
    check_prompt_chars,
    choice_usage,
    collect_until_disconnected,
    event_stream,
    refuse_unsupported,
    sampling_params,
    sse,
    timings,
    top_logprobs,
    usage,
)
from pagedllm.entrypoints.openai.serving_models import ServedModels
from pagedllm.entrypoints.openai.tools import (
    ToolPlan,
    ToolStream,
    calls_from_output,
    conversation_for_template,
    new_call_id,
    plan_tools,
    template_uses_tools,
)
from pagedllm.outputs import RequestOutput


class ServingChat:
    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        tokenizer: AsyncTokenizer,
        *,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = "hermes",
        truncate_history: bool = False,
    ) -> None:
        """tool_call_parser: reads tool calls out of free text (tool_choice auto); None refuses auto.
        truncate_history: a conversation too long for max_model_len loses its oldest turns
        (never its system messages or its last message) instead of getting a 400."""
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser
        self.truncate_history = truncate_history

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        model = self.models.resolve(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        refuse_unsupported(
            request,
            {"functions": bool(request.functions), "prompt_logprobs": request.prompt_logprobs is not None},
        )
        plan = plan_tools(request, self.tool_call_parser)
        params = sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=num_top,
            structured_outputs=plan.grammar if plan is not None else None,
        )
        render = functools.partial(
            self.prompt,
            add_generation_prompt=request.add_generation_prompt,
            template=request.chat_template,
            template_kwargs=request.chat_template_kwargs,
            tools=plan.tools if plan is not None else None,
        )
        texts = [entry["content"] for entry in _conversation(request.messages)]
        # The size bound holds for the server's template, which writes every message's text.
        own_template = request.chat_template is None and "chat_template" not in (
            request.chat_template_kwargs or {}
        )
        max_chars_per_token = self.tokenizer.max_chars_per_token if own_template else None
        cut = None
        if self.truncate_history and params.truncate_prompt_tokens is None:
            prompt, cut = await fit_history(
                request.messages,
                texts,
                self._room(max_tokens),
                render=render,
                count_tokens=self._count_tokens,
                max_chars_per_token=max_chars_per_token,
            )
        else:
            max_len = self.models.max_model_len
            check_prompt_chars("messages", sum(map(len, texts)), max_len, max_chars_per_token)
            prompt = await render(request.messages)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.engine.generate(
            [prompt],
            params,
            request_id=response_id,
            arrival_time=arrival_time,
            cache_salt=request.cache_salt,
            user=request.user,
            lora_request=self.models.lora_request(model),
        )
        if request.stream:
            return StreamingResponse(
                self._stream(request, stream, response_id, model, params.n, num_top, plan, cut),
                media_type="text/event-stream",
            )
        outputs = await collect_until_disconnected(raw_request, stream)
        if outputs is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            message = _message(completion.text, plan)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=_logprobs(output, 0, len(completion.token_ids), num_top),
                    finish_reason=_finish_reason(completion.finish_reason, plan, bool(message.tool_calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        return Response(
            ChatCompletionResponse(
                id=response_id,
                model=model,
                choices=choices,
                usage=_with_cut(usage(dict(enumerate(outputs)), params.n), cut),
                timings=timings(outputs[0]),
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
        plan: ToolPlan | None,
        cut: HistoryCut | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        continuous = options is not None and options.continuous_usage_stats
        tracker = DeltaTracker(len(stream.req_ids))
        latest: dict[int, RequestOutput] = {}
        tool_streams = [ToolStream(plan) for _ in stream.req_ids]

        def chunk(choice: ChatStreamChoice, output: RequestOutput | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=choice_usage(output) if continuous and output is not None else None,
                    timings=timings(output) if output is not None and output.finished else None,
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
            tools = tool_streams[index]
            content, calls = tools.feed(text, completion.finished)
            if not content and not calls and not completion.finished and (num_top is None or start == end):
                return
            choice = ChatStreamChoice(
                index=index,
                delta=DeltaMessage(content=content or (None if calls else ""), tool_calls=calls or None),
                logprobs=_logprobs(output, start, end, num_top),
                finish_reason=_finish_reason(completion.finish_reason, plan, tools.num_calls > 0),
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
                        usage=_with_cut(usage(latest, n), cut),
                    )
                )

        return event_stream(stream, first, chunks, last)

    def _room(self, max_tokens: int | None) -> int:
        """Prompt tokens that leave room for max_tokens (one token if unset)."""
        room = self.models.max_model_len - (max_tokens or 1)
        if room < 1:
            raise ValueError(
                f"max_tokens: {max_tokens:,} leaves no room for a prompt in max_model_len "
                f"{self.models.max_model_len:,}"
            )
        return room

    async def _count_tokens(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in await self.tokenizer.encode(texts, add_special_tokens=False)]

    async def prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The conversation rendered and tokenized, on the tokenizer's thread. A template sent by
        the client (chat_template, or chat_template_kwargs.chat_template) is code: it runs only
        with --trust-request-chat-template. `tools` go to a template that uses them, else into
        the conversation as text (tools.conversation_for_template). The template renders within
        the server's time budget and the characters a prompt of max_model_len can hold."""
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
        conversation = _conversation(messages)
        template_tools = None
        if tools is not None or any(m.get("role") == "tool" or m.get("tool_calls") for m in conversation):
            source = template if template is not None else self.tokenizer.tokenizer.chat_template
            if template_uses_tools(source):
                template_tools = tools or None
            else:
                conversation = conversation_for_template(conversation, tools or [], template_has_tools=False)
        return await self.tokenizer.chat_prompt(
            conversation,
            add_generation_prompt,
            template=template,
            template_kwargs=template_kwargs,
            tools=template_tools,
            max_model_len=self.models.max_model_len,
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


def _with_cut(usage_info: UsageInfo, cut: HistoryCut | None) -> UsageInfo:
    if cut is not None:
        usage_info.dropped_messages, usage_info.dropped_prompt_tokens = cut.messages, cut.tokens
    return usage_info


def _message(text: str, plan: ToolPlan | None) -> ChatMessageOut:
    if plan is None or plan.mode == "none":
        return ChatMessageOut(content=text)
    content, calls = calls_from_output(plan, text)
    return ChatMessageOut(
        content=content,
        tool_calls=[
            ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls
        ],
    )


def _finish_reason(reason: str | None, plan: ToolPlan | None, has_calls: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required) and stopped on its own;
    a named function ends with "stop", as the call was the client's choice."""
    if reason == "stop" and has_calls and plan is not None and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


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
