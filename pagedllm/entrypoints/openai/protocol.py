"""The OpenAI API's request and response bodies, as pydantic models and nothing else.

Requests take OpenAI's fields plus vLLM's extensions (top_k, min_p, repetition_penalty, ...);
unknown fields are ignored, as vLLM's server does. A field left out or sent as null keeps the
engine's default. Fields pagedllm does not implement yet (echo, suffix, ...) are declared so that
a request using them gets a 400 naming the field instead of silent results
(serving_common.refuse_unsupported). Every string in a body must be valid Unicode (JSON can
carry a lone surrogate such as "\ud800", which nothing downstream can encode), and nesting is
bounded by limits.MAX_JSON_DEPTH.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedllm import limits
from pagedllm.outputs import Logprob


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            try:
                limits.check_text_and_depth(data)
            except ValueError as error:
                raise _body_error(str(error)) from None
            return {k: v for k, v in data.items() if v is not None}
        return data


def _body_error(message: str) -> PydanticCustomError:
    # passed as context: the message may quote keys the client chose, braces included
    return PydanticCustomError("invalid_body", "{message}", {"message": message})


# ---- requests ------------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """A last chunk, with no choices, carries the usage of the whole request."""
    continuous_usage_stats: bool = False
    """Every chunk carries the usage so far of its choice (vLLM's extension)."""


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    """Accepted; the output always follows the schema (the grammar allows nothing else)."""


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    json_: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None


class SamplingFields(OpenAIModel):
    """What both generation endpoints share: the model, sampling, stopping, streaming."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep the prompt's last k tokens (-1: as many as leave room for max_tokens)."""
    prompt_logprobs: int | None = None
    """vLLM's: the top k log-probabilities of every prompt token after the first (completions only)."""
    priority: int = 0
    """Accepted for vLLM compatibility; the scheduler is first-come first-served."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    """{token id (as a string, OpenAI's form): bias in [-100, 100]} added to the logits."""
    response_format: ResponseFormat | None = None
    """OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}."""
    structured_outputs: StructuredOutputsFields | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Top log-probabilities per token (0: the sampled token's only)."""
    best_of: int | None = None
    """Only best_of == n (or left out) is served."""
    echo: bool = False
    """Not served: true is refused with a 400."""
    suffix: str | None = None
    """Not served: a suffix is refused with a 400."""


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class MessageFunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"
    """JSON text, as OpenAI sends it (an object is taken as it is)."""


class MessageToolCall(OpenAIModel):
    """A call an earlier assistant message made: checked here, as templates and tools.py read it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    """One message; fields pagedllm reads are checked, others go to the chat template as they are."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments."""
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: ToolChoiceFunction


_TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens; wins when both are given. None: up to max_model_len."""
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    """A client's own Jinja chat template: refused unless the server runs with
    --trust-request-chat-template (a template is code)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (its own arguments, such as messages, are refused)."""
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """none | auto (the default with tools) | required | {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool | None = None
    """False: at most one call (tool_choice required)."""
    functions: list[dict[str, Any]] | None = None
    """OpenAI's deprecated tools field: refused like tools."""

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        """One message for every wrong shape (pydantic's own would name each member of the union)."""
        function = value.get("function") if isinstance(value, dict) else None
        if (isinstance(value, str) and value in _TOOL_CHOICES) or (
            isinstance(value, dict)
            and value.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            return value
        raise _body_error(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Timings(BaseModel):
    """Where one sequence's time went (llama.cpp's server names where they mean the same):
    queue_ms waiting for a seat; prompt_ms the prefill of prompt_n prompt tokens (cache_n more
    came from the prefix cache); predicted_ms the decode, first to last of predicted_n tokens."""

    queue_ms: float
    prompt_n: int
    cache_n: int
    prompt_ms: float
    prompt_per_token_ms: float | None
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float | None
    """predicted_ms over the predicted_n - 1 gaps between tokens (vLLM's TPOT)."""
    predicted_per_second: float | None
    draft_n: int | None = Field(default=None, exclude_if=lambda v: v is None)
    """Speculative decoding: draft tokens checked for the sequence, and of them accepted."""
    draft_n_accepted: int | None = Field(default=None, exclude_if=lambda v: v is None)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    dropped_messages: int | None = Field(default=None, exclude_if=lambda v: v is None)
    """--truncate-chat-history: the oldest messages left out to fit max_model_len."""
    dropped_prompt_tokens: int | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )
    """With prompt_logprobs: per prompt token (None for the first), in a stream's first chunk."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole response, and (with usage None until the last) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = Field(default=None, exclude_if=lambda v: v is None)
    """Of choice 0 in a whole response; of the choice that ends, in its stream's last chunk."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    timings: Timings | None = Field(default=None, exclude_if=lambda v: v is None)
    """Of choice 0 (each choice's own: its last stream chunk)."""


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = Field(default=None, exclude_if=lambda v: v is None)
    """In the chunk where a choice ends: that choice's timings."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class EmbeddingRequest(OpenAIModel):
    """OpenAI's /v1/embeddings body (and vLLM's `truncate_prompt_tokens`)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The vector, or its float32 bytes (little-endian) in base64."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocumentText(OpenAIModel):
    text: str


class RerankRequest(OpenAIModel):
    """/rerank (Jina's and Cohere's shape, as vLLM and llama.cpp serve it)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocumentText]
    top_n: int | None = None
    """The best top_n results (all by default)."""
    return_documents: bool = True
    instruction: str | None = None
    """The reranker's task description (Qwen3-Reranker's <Instruct>); a default when left out."""
    user: str | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocumentText | None = Field(default=None, exclude_if=lambda v: v is None)


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(OpenAIModel):
    """/score (vLLM's): text_1 against each text_2 (or pairwise, a list against a list)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class ErrorResponse(BaseModel):
    error: ErrorInfo


class LoadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None
