"""SamplingParams: how one request picks its tokens and when it stops (vLLM's fields and defaults)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm import limits
from pagedllm.json_schema import parse_json_schema
from pagedllm.pooling_params import PoolingParams

_GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's fields; exactly one of them is set).

    `json`: a JSON schema (dict or its text); `json_object`: any JSON object; `regex`: a regular
    expression; `choice`: one of these strings exactly; `grammar`: EBNF (xgrammar's dialect, GBNF
    style: `root ::= ...`). The output is compact JSON unless `disable_any_whitespace` is False:
    free whitespace lets a small model pad a reply with newlines until max_tokens.
    """

    json: str | dict[str, Any] | bool | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        asked = [kind for kind in _GRAMMAR_KINDS if getattr(self, kind) not in (None, False)]
        if len(asked) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(asked)})" if asked else "")
            )
        kind = asked[0]
        if kind == "json":
            assert self.json is not None  # `asked` names the fields that are set
            parse_json_schema(self.json)  # bounded depth first: `spec` dumps an object schema
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object: must be true")
        elif kind == "choice":
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise ValueError(f"structured_outputs.{kind}: must be a non-empty string")
        limits.check_text(f"structured_outputs.{kind}", self.spec, limits.MAX_GRAMMAR_SPEC_CHARS)

    @property
    def kind(self) -> str:
        return next(kind for kind in _GRAMMAR_KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The grammar as text: the key compiled grammars are cached under (with `kind`)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            return json.dumps(value)  # key order kept: properties come out in the schema's order
        if self.kind == "choice":
            return json.dumps(value)
        return "" if self.kind == "json_object" else value


@dataclass
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ValueError naming the field.

    `temperature=0` is greedy. `top_k` of None, 0 or -1 means no top-k (vLLM accepts all three).
    `stop` strings are cut from the output unless `include_stop_str_in_output`.
    `logprobs=k` returns the k most likely tokens per step (plus the sampled one), from the
    model's raw distribution, before penalties and temperature, as vLLM does by default.
    `prompt_logprobs=k` does the same for every prompt token after the first (teacher-forced
    scoring, e.g. perplexity); such a request never takes prefix-cache hits, since every
    prompt position must go through the model.
    `logit_bias` adds {token_id: bias} to the logits before sampling (OpenAI's field, -100..100).
    `structured_outputs` constrains every sampled token to a grammar (JSON schema, regex, ...).
    `truncate_prompt_tokens=k` keeps the prompt's last k tokens (-1: as many as max_model_len
    allows), as vLLM's field does: for histories that outgrow the context.
    `pooling` makes the request an embedding request (LLM.embed, /v1/embeddings make it): no token
    is sampled; its output is the prompt's pooled hidden state (pooling_params.py).
    Sizes are bounded by pagedllm.limits; token ids are checked against the vocabulary by the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    pooling: PoolingParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k in (0, -1):
            self.top_k = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(s for s in (self.stop or []) if s)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            limits.check_finite(name, getattr(self, name))
        limits.check_finite("repetition_penalty", self.repetition_penalty)
        need(
            isinstance(self.n, int) and 1 <= self.n <= limits.MAX_N,
            "n",
            f"must be an integer in [1, {limits.MAX_N}]",
        )
        need(self.temperature >= 0.0, "temperature", "must be >= 0")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(
            self.top_k is None or (isinstance(self.top_k, int) and 1 <= self.top_k <= limits.INT32_MAX),
            "top_k",
            f"must be in [1, {limits.INT32_MAX}] (or 0 / -1 / None to disable)",
        )
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1",
        )
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens})",
        )
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        need(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            "must be an integer >= 0",
        )
        need(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            "must be an integer >= 0",
        )
        stop_token_ids = self.stop_token_ids or []  # a list since __post_init__'s start
        need(
            len(stop_token_ids) <= limits.MAX_STOP_TOKEN_IDS
            and all(isinstance(t, int) and t >= 0 for t in stop_token_ids),
            "stop_token_ids",
            f"must be at most {limits.MAX_STOP_TOKEN_IDS} non-negative token ids",
        )
        need(
            len(self.stop or []) <= limits.MAX_STOP_STRINGS,
            "stop",
            f"takes at most {limits.MAX_STOP_STRINGS} strings",
        )
        for stop in self.stop or []:
            limits.check_text("stop", stop, limits.MAX_STOP_STRING_CHARS)
        low, high = limits.INT64_RANGE
        need(
            self.seed is None
            or (isinstance(self.seed, int) and low <= self.seed and self.seed + self.n - 1 <= high),
            "seed",
            f"must be an integer in [{low}, {high}] (seed + n - 1 too)",
        )
        self._validate_logit_bias()
        need(
            self.truncate_prompt_tokens is None
            or (
                isinstance(self.truncate_prompt_tokens, int)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
            ),
            "truncate_prompt_tokens",
            "must be an integer >= 1, or -1 (max_model_len)",
        )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs: must be a StructuredOutputsParams")
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise ValueError("pooling: must be a PoolingParams")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if len(self.logit_bias) > limits.MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: takes at most {limits.MAX_LOGIT_BIAS_ENTRIES} tokens")
        low, high = limits.LOGIT_BIAS_RANGE
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias: {token_id!r} is not a token id")
            limits.check_finite("logit_bias", bias)
            if not low <= bias <= high:
                raise ValueError(
                    f"logit_bias: the bias of token {token_id} must be in [{low:g}, {high:g}], got {bias}"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def per_sequence(self) -> list[SamplingParams]:
        """One n=1 copy per sequence: sequence j draws with seed + j, as vLLM fans out n."""
        if self.n == 1:
            return [self]
        seeds = [None] * self.n if self.seed is None else [self.seed + j for j in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]
