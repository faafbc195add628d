"""Plain values passed along the data path: scheduler -> model runner -> scheduler -> engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner does not hold: scheduled for the first time, or again after a
    preemption gave its blocks back. Everything the runner keeps in its input batch; from then
    on each step sends only what changed (CachedRequestData). The lists are read only."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption; empty the first time."""
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    """The requests the runner holds that this step schedules again, one column per field (a
    struct of arrays, as vLLM's): the blocks each got since its last step, and its computed count."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass(frozen=True)
class KVTransfers:
    """Block copies between the KV cache and the disk tier (worker/kv_offload/), as
    (block_id, block_hash) pairs, that every rank does at the start of the step, before its
    forward: saves first (a block evicted this step may be reused by this step's forward), then
    loads (a lookup's disk hit, into a fresh block)."""

    saves: list[tuple[int, bytes]] = field(default_factory=list)
    loads: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step, in ids and counts: a delta to the runner's input batch (new requests whole,
    held ones by what changed) and each scheduled request's share of the step. A request samples
    its next token when its share reaches its last known token; the runner knows its counts."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Request id -> its tokens this step, in batch order (the model's rows follow it)."""
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    """Requests whose blocks a preemption took this step; the runner drops their rows too."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step; the runner drops their state."""
    kv_transfers: KVTransfers | None = None
    """The disk tier's copies before this step's forward (None: none)."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> the draft tokens it checks this step (speculative decoding): scheduled
    after its last known token, which they follow in its row of the input batch."""


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]
    """Request id -> its new tokens: one, or with draft tokens the accepted ones and one more."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> draft tokens proposed for its next step (speculative decoding)."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """For requests that asked: one entry per new token."""
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """For requests that asked: one entry per prompt token this step scored."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose own part of the step (sampling, prompt scoring) raised: id -> what was raised."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Embedding requests whose prompt ended this step: id -> the pooled vector (their output)."""
    grammar_dead_ends: dict[str, int] = field(default_factory=dict)
    """The step's GrammarBitmask.dead_ends: a constrained request whose grammar allowed no token
    after its first n draft tokens (structured output with drafts) -> n."""


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
    pooled: list[float] | None = None
    """An embedding request's output (it ends with it)."""
