"""What the completion and chat endpoints share: sampling params from a request, a size bound on
prompts checked before tokenizing, usage, server-sent events, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from pagedllm.engine.async_engine import RequestStream
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.engine.input_processor import PromptType
from pagedllm.entrypoints.openai.errors import error_json, to_api_error
from pagedllm.entrypoints.openai.protocol import PromptTokensDetails, SamplingFields, Timings, UsageInfo
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

T = TypeVar("T")

_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
)
SSE_DONE = "data: [DONE]\n\n"


def sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Fields sent as null keep SamplingParams' defaults. Raises ValueError naming a bad field.
    `structured_outputs` (a tool call's grammar) takes the place of the request's own."""
    fields = {name: getattr(request, name) for name in _SAMPLING_FIELDS if getattr(request, name) is not None}
    return SamplingParams(
        **fields,
        max_tokens=max_tokens,
        logprobs=logprobs,
        logit_bias=_logit_bias(request.logit_bias),
        structured_outputs=structured_outputs or requested_structured_outputs(request),
    )


def requested_structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The grammar a request asks for: OpenAI's response_format or vLLM's structured_outputs."""
    response_format, fields = request.response_format, request.structured_outputs
    if response_format is not None and response_format.type != "text" and fields is not None:
        raise ValueError("structured_outputs: give response_format or structured_outputs, not both")
    if fields is not None:
        return StructuredOutputsParams(
            json=fields.json_,
            json_object=fields.json_object,
            regex=fields.regex,
            choice=fields.choice,
            grammar=fields.grammar,
            disable_any_whitespace=fields.disable_any_whitespace is not False,
        )
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise ValueError("response_format.json_schema: a json_schema format needs json_schema.schema")
    return StructuredOutputsParams(json=spec.schema_)


def refuse_unsupported(request: SamplingFields, unsupported: dict[str, bool]) -> None:
    """ValueError naming the first field asked for that pagedllm does not serve: a user who asked
    for something must not get a result with no sign why. `unsupported`: {field: whether asked}."""
    for name, asked in unsupported.items():
        if asked:
            raise ValueError(f"{name}: not supported by this server (yet); leave it out")


def check_prompt_chars(field: str, num_chars: int, max_tokens: int, max_chars_per_token: int | None) -> None:
    """ValueError if `num_chars` characters of text cannot be fewer than `max_tokens` tokens,
    found without tokenizing them: a body of megabytes is refused in microseconds, not after
    seconds on the tokenizer thread that every request shares."""
    if max_chars_per_token is not None and num_chars > max_tokens * max_chars_per_token:
        raise ValueError(
            f"{field}: {num_chars:,} characters are at least {-(-num_chars // max_chars_per_token):,} "
            f"tokens (a token of this model holds at most {max_chars_per_token} characters), over "
            f"the {max_tokens:,} that fit in max_model_len"
        )


async def tokenized_texts(
    field: str, texts: list[str], tokenizer: AsyncTokenizer, max_model_len: int, *, truncated: bool
) -> list[PromptType]:
    """Text prompts as the engine takes them, each with its token ids: tokenized on the
    tokenizer's thread, after the size bound (check_prompt_chars, naming `field`) unless
    truncate_prompt_tokens will cut them."""
    if not truncated:
        for text in texts:
            check_prompt_chars(field, len(text), max_model_len, tokenizer.max_chars_per_token)
    token_ids = await tokenizer.encode(texts)
    return [{"prompt": text, "prompt_token_ids": ids} for text, ids in zip(texts, token_ids, strict=True)]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    if bias is None:
        return None
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise ValueError("logit_bias: keys must be token ids (integers)") from None


def usage(outputs: Mapping[int, RequestOutput], n: int) -> UsageInfo:
    """Totals over the choices; a prompt shared by its n choices counts once (choice i*n)."""
    firsts = [output for index, output in outputs.items() if index % n == 0]
    prompt_tokens = sum(len(output.prompt_token_ids) for output in firsts)
    completion_tokens = sum(len(output.outputs[0].token_ids) for output in outputs.values())
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(output.num_cached_tokens for output in firsts)
        ),
    )


def timings(output: RequestOutput) -> Timings:
    """The sequence's queue, prefill and decode time, from the engine's own timestamps."""
    metrics = output.metrics
    prompt_n = len(output.prompt_token_ids) - output.num_cached_tokens
    predicted_n = len(output.outputs[0].token_ids)
    prompt_s, decode_s = metrics.prefill_time or 0.0, metrics.decode_time or 0.0
    gaps = predicted_n - 1
    return Timings(
        queue_ms=(metrics.queue_time or 0.0) * 1e3,
        prompt_n=prompt_n,
        cache_n=output.num_cached_tokens,
        prompt_ms=prompt_s * 1e3,
        prompt_per_token_ms=prompt_s * 1e3 / prompt_n if prompt_n else None,
        prompt_per_second=prompt_n / prompt_s if prompt_s else None,
        predicted_n=predicted_n,
        predicted_ms=decode_s * 1e3,
        predicted_per_token_ms=decode_s * 1e3 / gaps if gaps > 0 else None,
        predicted_per_second=gaps / decode_s if gaps > 0 and decode_s else None,
        draft_n=None if output.draft_tokens is None else output.draft_tokens[0],
        draft_n_accepted=None if output.draft_tokens is None else output.draft_tokens[1],
    )


def choice_usage(output: RequestOutput) -> UsageInfo:
    """Usage so far of one choice (stream_options.continuous_usage_stats)."""
    return usage({0: output}, 1)


class DeltaTracker:
    """How much of each choice's cumulative output a stream has sent: the next chunk is the rest."""

    def __init__(self, num_choices: int) -> None:
        self.num_chars = [0] * num_choices
        self.num_tokens = [0] * num_choices

    def advance(self, index: int, output: RequestOutput) -> tuple[str, int, int]:
        """The new text, and the range [start, end) of new token positions."""
        completion = output.outputs[0]
        text = completion.text[self.num_chars[index] :]
        start, end = self.num_tokens[index], len(completion.token_ids)
        self.num_chars[index] = len(completion.text)
        self.num_tokens[index] = end
        return text, start, end


def top_logprobs(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    """The num_top most likely tokens at one position (the sampled one only if it is among them)."""
    return sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num_top]


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def event_stream(
    stream: RequestStream,
    first: Iterable[str],
    chunks: Callable[[int, RequestOutput], Iterable[str]],
    last: Callable[[], Iterable[str]],
) -> AsyncIterator[str]:
    """SSE text: `first`, then chunks(index, output) per update, `last()`, `data: [DONE]`.

    An engine error mid-stream becomes an error event (the status line has already gone out).
    When the client disconnects, starlette cancels this generator and the finally aborts.
    """
    try:
        for chunk in first:
            yield chunk
        async for updates in stream:
            for index in sorted(updates):
                for chunk in chunks(index, updates[index]):
                    yield chunk
        for chunk in last():
            yield chunk
    except Exception as error:
        yield f"data: {error_json(to_api_error(error))}\n\n"
    finally:
        stream.close()
    yield SSE_DONE


async def collect_until_disconnected(request: Request, stream: RequestStream) -> list[RequestOutput] | None:
    """Every final output of `stream`, or None if the client disconnects first. The stream is closed
    either way, so an abandoned request is aborted and its blocks freed at once."""
    try:
        return await _until_disconnected(request, stream.collect())
    finally:
        stream.close()


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (then None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
