"""DraftPolicy: speculative decoding's policy, apart from the scheduler that asks it. It decides how
many of its proposed draft tokens each decoding request checks this step, from what a draft row
costs a step of this size (StepCostModel, fitted from the steps' timings the engine reports) and
from the share of its recent draft tokens the request had accepted (a record that fades).

It keeps, by req_id, the draft the runner proposed for a request's next step and the request's
acceptance record; the scheduler tells it when a request is preempted (its draft is dropped: the
runner proposes again once it has resumed) and when it ends (all dropped).

Why in core/ and not spec_decode/: the scheduler builds this default policy from the config, and
core may not import spec_decode (tests/test_layering.py: spec_decode sits above core, with model
and sample). The policy is bookkeeping like the rest of core (no torch, no model): it reads
counts, timings and a request's grammar. Speculation's mechanism lives above: the proposers and
the runner's step in spec_decode/, the check of draft tokens in sample/rejection.py. A test (or
an engine) injects its own policy: Scheduler(..., draft_policy=DraftPolicy(spec, step_cost)).
"""

from __future__ import annotations

import logging
import math

from pagedllm.core.step_cost import StepCostModel
from pagedllm.metrics.stats import SpecDecodeStats
from pagedllm.request import Request
from pagedllm.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

DRAFT_FADE = 0.8
"""How fast a request's record of accepted drafts forgets: each checking step's counts weigh this
much less at the next."""


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig, step_cost: StepCostModel | None = None) -> None:
        """step_cost: what a draft row costs; by default fitted from the engine's step timings
        (a test pins it: a cost model whose row_cost is 0, "rows free")."""
        self.config = config
        self.step_cost = step_cost if step_cost is not None else StepCostModel()
        self.stats = SpecDecodeStats()
        """Drafts checked and accepted, over all requests (the engine's metrics)."""
        self._proposals: dict[str, list[int]] = {}
        """req_id -> draft tokens proposed for its next step (checked, not yet known)."""
        self._recent: dict[str, tuple[float, float]] = {}
        """req_id -> draft tokens accepted and checked over its recent checking steps, each
        step's counts fading by DRAFT_FADE."""

    # ---- what a step checks ----------------------------------------------------------------

    def drafts_to_check(self, request: Request, max_fit: int, num_running: int) -> list[int]:
        """The draft tokens a decoding request checks this step: what it was proposed, cut to
        max_fit (what the step's budget and max_model_len leave, the scheduler says) and to
        max_tokens, and to none where a draft row is not worth its cost: a request checks
        drafts while the share of them it has been accepting beats what a row costs a step of
        num_running rows; otherwise one draft token now and then (a probe, so a request that
        starts quoting its context is noticed), rarer as rows get dearer, so probes cost a step
        about 1% at most.

        A constrained request's draft stops before the first token its grammar refuses (that one
        could not be accepted); where the grammar itself forces a longer run of tokens from here
        (a JSON schema's keys and punctuation: xgrammar's jump-forward tokens), that run is the
        draft instead, up to num_speculative_tokens."""
        proposed = self._proposals.get(request.req_id, [])
        if not (proposed or request.grammar is not None):
            return []
        limit_batch = self.config.disable_by_batch_size
        if limit_batch is not None and num_running >= limit_batch:
            return []
        limit = min(max_fit, request.max_tokens - request.num_output_tokens - 1)
        row_cost = self.step_cost.row_cost(num_running)
        if self.acceptance(request.req_id) <= row_cost:
            probe_every = max(8, math.ceil(100 * row_cost))
            limit = min(limit, 1 if request.num_output_tokens % probe_every == 0 else 0)
        if limit <= 0:
            return []
        if request.grammar is not None:
            try:
                return self._constrained_draft(request, proposed)[:limit]
            except Exception:  # its matcher's fault: no drafts, and the bitmask fails it alone
                logger.exception("Request %s: its grammar could not check drafts", request.req_id)
                return []
        return proposed[:limit]

    def _constrained_draft(self, request: Request, proposed: list[int]) -> list[int]:
        """The longer of the proposer's draft up to the first token the grammar refuses and the
        tokens the grammar forces from here. Forced tokens only once min_tokens is reached, as the
        proposer's (min_tokens bans tokens by position)."""
        assert request.grammar is not None
        proposed = proposed[: request.grammar.valid_prefix(proposed)] if proposed else []
        if request.num_output_tokens < request.sampling_params.min_tokens:
            return proposed
        forced = request.grammar.forced_tokens()[: self.config.num_speculative_tokens]
        return forced if len(forced) > len(proposed) else proposed

    def acceptance(self, req_id: str) -> float:
        """The share of the request's recent draft tokens accepted; 1 before any (one more of
        each counted: a first rejection does not stop a request's drafts at once)."""
        accepted, checked = self._recent.get(req_id, (0.0, 0.0))
        return (accepted + 1) / (checked + 1)

    # ---- what the scheduler reports ----------------------------------------------------------

    def record_step_time(self, num_rows: int, seconds: float) -> None:
        """A step of num_rows rows took this long (the forward and sampling)."""
        self.step_cost.record(num_rows, seconds)

    def record(self, request: Request, draft: list[int], num_sampled: int, proposal: list[int]) -> None:
        """After a step of this request: it checked `draft` and sampled num_sampled tokens (the
        accepted draft tokens and one more; 0: it did not sample), and the runner proposed
        `proposal` for its next step. The request's own totals (per-response timings) grow too."""
        if proposal:
            self._proposals[request.req_id] = proposal
        else:
            self._proposals.pop(request.req_id, None)
        if not (draft and num_sampled):
            return
        num_accepted = num_sampled - 1
        self.stats.record(len(draft), num_accepted)
        request.num_draft_tokens += len(draft)
        request.num_accepted_tokens += num_accepted
        accepted, checked = self._recent.get(request.req_id, (0.0, 0.0))
        accepted, checked = DRAFT_FADE * accepted + num_accepted, DRAFT_FADE * checked + len(draft)
        self._recent[request.req_id] = (accepted, checked)

    def preempted(self, req_id: str) -> None:
        """Its K/V is gone: the draft proposed after its last step is dropped (the record stays)."""
        self._proposals.pop(req_id, None)

    def finished(self, req_id: str) -> None:
        """It ended (stopped, aborted, failed): drop all kept for it."""
        self._proposals.pop(req_id, None)
        self._recent.pop(req_id, None)
