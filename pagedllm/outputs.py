"""What the offline API and the engine return, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass

INVALID_REQUEST = "invalid request: "
"""Opens RequestOutput.error when the request's own content made it fail (a grammar this
vocabulary cannot finish): the server answers 400 for it, not 500."""


@dataclass
class RequestMetrics:
    """Timestamps on the monotonic clock, as vLLM defines its intervals:
    queue = queued -> first_scheduled, prefill = first_scheduled -> first_token,
    decode = first_token -> last_token."""

    arrival_time: float
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return _span(self.queued_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.last_token_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def e2e_latency(self) -> float | None:
        return _span(self.arrival_time, self.finished_time)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: {token_id: Logprob} for the sampled token and the top-k."""
    finish_reason: str | None = None
    """stop | length | abort | error, None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if one did."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (0 without a hit)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt token (None for the first)."""
    error: str | None = None
    """Why the request failed, when its finish_reason is "error"."""
    num_preemptions: int = 0
    """Times the scheduler took this request's blocks back and recomputed it."""
    draft_tokens: tuple[int, int] | None = None
    """Speculative decoding: (draft tokens checked, accepted) for this request; None when off."""
    embedding: list[float] | None = None
    """An embedding request's vector (SamplingParams.pooling), once finished."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, as vLLM's: `outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair, as vLLM's: `outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
