"""Plain values passed along the data path: scheduler -> model runner -> scheduler -> engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, in ids and counts.

    The runner computes `token_ids` at positions `num_computed_tokens ...`, writing their K/V
    into the slots named by `block_ids`, and samples a token when `do_sample` (this step
    reaches the request's last known token). The lists are the request's own: read only.
    """

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    do_sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length once this step's tokens are in the cache."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step; the runner drops their state."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """For requests that asked: one entry per prompt token this step scored."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose own part of the step (sampling, prompt scoring) raised: id -> what was raised."""


@dataclass
class EngineCoreOutput:
    """What a step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
