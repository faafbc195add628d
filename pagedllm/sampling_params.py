"""SamplingParams: how one request picks its tokens and when it stops (vLLM's fields and defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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

        need(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        need(self.temperature >= 0.0, "temperature", "must be >= 0")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(
            self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
            "top_k",
            "must be >= 1 (or 0 / -1 / None to disable)",
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
        need(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        need(all(isinstance(s, str) for s in self.stop or []), "stop", "must be strings")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")

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
