"""The model runner's side of speculative decoding: during a step, the check of the draft tokens it
carries (sample/rejection.py); after it, draft tokens for the next step of each request that
sampled (the proposer). The runner calls these; how many drafts a request checks is decided
elsewhere, by the scheduler's DraftPolicy (core/draft_policy.py), and arrives with the step.

It reads the runner's input batch through DraftBatch, the few members it needs: worker/ sits above
spec_decode/ (tests/test_layering.py), so the batch's class is not imported here.

A step's logits hold len(draft) + 1 rows for each sampling request (its last known token, then
each draft token; a request without drafts: one row), requests in the order of `sampled_rows`:

    drafts:       []    [7, 8]        []    [3]
    logits rows:  0     1   2   3     4     5   6
    first rows:   0     1             4     5
"""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

import numpy as np
import torch

from pagedllm.core.outputs import TokenLogprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection import RejectionSampler
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.speculative_config import SpeculativeConfig


class DraftBatch(Protocol):
    """What the runner's input batch (worker/input_batch.py) offers speculation."""

    req_ids: list[str]
    token_ids: np.ndarray
    num_tokens: np.ndarray

    def speculates(self, row: int) -> bool: ...

    def sampling_metadata(
        self, rows: list[int], drafts_before: list[int] | None = None
    ) -> SamplingMetadata: ...


class SpecDecodeStep:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, sampler: Sampler) -> None:
        """sampler: the runner's, whose adjustments and generator the check shares."""
        self.config = config
        self.proposer = proposer
        self.rejection_sampler = RejectionSampler(sampler)

    def finish(self, req_ids: list[str]) -> None:
        """These requests ended: the proposer drops what it kept for them alone."""
        for req_id in req_ids:
            self.proposer.finish(req_id)

    def verify(
        self,
        batch: DraftBatch,
        logits: torch.Tensor,
        first_logits: list[int],
        sampled_rows: list[int],
        drafts: list[list[int]],
        group: list[int],
    ) -> tuple[list[int], list[list[int]], list[list[TokenLogprobs | None]]]:
        """Check the drafts of the sampling requests `group` (indices into sampled_rows, drafts
        and first_logits) at once.

        Args:
            logits: [rows of the step's logits, vocab], laid out as the module docstring draws.

        Returns:
            The batch rows of the group, and for each its tokens (the accepted draft tokens, then
            one more) and their logprobs.
        """
        rows = [sampled_rows[i] for i in group]
        logits_rows = [first_logits[i] + j for i in group for j in range(len(drafts[i]) + 1)]
        metadata_rows = [sampled_rows[i] for i in group for _ in range(len(drafts[i]) + 1)]
        drafts_before = [j for i in group for j in range(len(drafts[i]) + 1)]
        metadata = batch.sampling_metadata(metadata_rows, drafts_before)
        tokens, logprobs = self.rejection_sampler(logits[logits_rows], metadata, [drafts[i] for i in group])
        return rows, tokens, logprobs

    def propose(self, batch: DraftBatch, rows: list[int], sampled: Container[str]) -> dict[str, list[int]]:
        """Draft tokens for the next step of the requests in `rows` that sampled this step and may
        speculate (min_tokens reached), by req_id; none for a request the proposer has none for.
        Called after the sampled tokens were appended to the batch."""
        proposals = {}
        for row in rows:
            req_id = batch.req_ids[row]
            if req_id not in sampled or not batch.speculates(row):
                continue
            context = batch.token_ids[row, : int(batch.num_tokens[row])]
            draft = self.proposer.propose(req_id, context, self.config.num_speculative_tokens)
            if draft:
                proposals[req_id] = draft
        return proposals


def first_logits_rows(drafts: list[list[int]]) -> list[int]:
    """Each sampling request's first row of the step's logits: len(draft) + 1 rows each."""
    firsts, at = [], 0
    for draft in drafts:
        firsts.append(at)
        at += len(draft) + 1
    return firsts
