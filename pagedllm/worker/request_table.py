"""The runner's own copy of the requests it computes, kept from their first step to their last.

The scheduler sends a request whole once (NewRequestData: prompt, sampling params, blocks), then
each step only what changed (CachedRequestData: new block ids, counts). The table applies those
deltas; tokens the runner samples it appends itself. Block ids live in one persistent tensor,
a row per request, written in place as blocks arrive, so a step's block tables are a row gather,
not a tensor rebuilt from Python lists.

    step N:   finished / preempted ids -> rows freed    new requests -> rows taken
              cached requests -> new block ids written at the end of their rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.outputs import NewRequestData, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Every token sampled so far (by this runner, or before a preemption)."""
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    num_computed_tokens: int
    row: int
    """Its row of the block table."""
    num_blocks: int = 0


@dataclass(frozen=True)
class StepRequest:
    """A held request's share of one step, as the input builder reads it (the sampler reads
    sampling_metadata() of a batch of them)."""

    state: CachedRequestState
    num_scheduled_tokens: int
    do_sample: bool

    @property
    def req_id(self) -> str:
        return self.state.req_id

    @property
    def num_computed_tokens(self) -> int:
        return self.state.num_computed_tokens

    @property
    def seq_len(self) -> int:
        """Context length once this step's tokens are in the cache."""
        return self.state.num_computed_tokens + self.num_scheduled_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes."""
        start, end = self.state.num_computed_tokens, self.seq_len
        prompt, outputs = self.state.prompt_token_ids, self.state.output_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:  # a decode, or recomputing outputs after a preemption
            return outputs[start - num_prompt : end - num_prompt]
        return prompt[start:] + outputs[: end - num_prompt]

    @property
    def sampling_params(self) -> SamplingParams:
        return self.state.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids


def sampling_metadata(batch: list[StepRequest]) -> SamplingMetadata:
    """What the sampler reads of these requests, in batch order; the token lists are shared."""
    states = [step.state for step in batch]
    return SamplingMetadata(
        req_ids=[s.req_id for s in states],
        params=[s.sampling_params for s in states],
        prompt_token_ids=[s.prompt_token_ids for s in states],
        output_token_ids=[s.output_token_ids for s in states],
        eos_token_ids=[s.eos_token_ids for s in states],
    )


class RequestTable:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.long)
        """[max_num_reqs, max_blocks_per_req]: row r holds its request's block ids, then zeros."""
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def update(self, scheduler_output: SchedulerOutput) -> list[StepRequest]:
        """Apply a step's deltas; returns the step's requests in batch order."""
        for req_id in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        batch = []
        for scheduled in scheduler_output.scheduled:
            if isinstance(scheduled, NewRequestData):
                state = self._add(scheduled)
                block_ids = scheduled.block_ids
            else:
                state = self.requests[scheduled.req_id]
                block_ids = scheduled.new_block_ids
            if block_ids:
                end = state.num_blocks + len(block_ids)
                self.block_table[state.row, state.num_blocks : end] = torch.tensor(block_ids)
                state.num_blocks = end
            state.num_computed_tokens = scheduled.num_computed_tokens
            batch.append(StepRequest(state, scheduled.num_scheduled_tokens, scheduled.do_sample))
        return batch

    def append_sampled(self, sampled_token_ids: dict[str, int]) -> None:
        """Tokens sampled elsewhere (tensor parallelism: by rank 0) for requests held here; a
        request finished or preempted since is not held, and its token is dropped."""
        for req_id, token in sampled_token_ids.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.output_token_ids.append(token)

    def block_tables(self, batch: list[StepRequest], num_blocks: int) -> torch.Tensor:
        """[len(batch), num_blocks]: the batch's rows, each request's blocks then zeros."""
        rows = torch.tensor([step.state.row for step in batch])
        return self.block_table[rows, :num_blocks]

    def _add(self, new: NewRequestData) -> CachedRequestState:
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            num_computed_tokens=new.num_computed_tokens,
            row=self._free_rows.pop(),
        )
        self.block_table[state.row].zero_()
        self.requests[new.req_id] = state
        return state
