"""Plain values passed along the data path: scheduler -> model runner -> scheduler -> engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.bitmask import GrammarBitmask


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner does not hold: scheduled for the first time, or again after a
    preemption gave its blocks back. Everything the runner keeps in its request table; from then
    on each step sends only what changed (CachedRequestData). The lists are the request's own:
    read only, except output_token_ids, a copy."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption; empty the first time."""
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    do_sample: bool
    """This step reaches the request's last known token: sample the next one."""


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner holds: the blocks it got since its last step, and this step's share."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    do_sample: bool


ScheduledRequest = NewRequestData | CachedRequestData


@dataclass
class SchedulerOutput:
    """One step, in ids and counts: the requests to compute, in batch order."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    """Requests whose blocks a preemption took this step; the runner drops their state too."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step; the runner drops their state."""
    grammar_bitmask: GrammarBitmask | None = None
    """Which tokens the constrained requests sampling this step may take (structured output)."""

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
