"""Scheduler: the policy. Each step it decides which requests compute how many tokens.

One token-count model: every request has `num_computed_tokens` catching up with
`num_tokens`. A decode is a request one token behind; a prefill chunk is a request many
tokens behind, capped by the step's token budget. Prefix hits start a request ahead;
preemption sets it back to 0. There is no separate prefill path.

A step:
1. Running requests, oldest first, each get the tokens they lack (a decode: 1). A prefill
   chunk is capped so every running request after it still gets its token: decodes are
   never starved by a long prompt. When the pool is short, the newest running request
   is preempted (blocks freed, recomputed later) until the allocation fits.
2. If nobody was preempted, waiting requests are admitted (arrival order, or longest
   cached prefix first with `lpm`) while seats, budget and blocks allow, and (with
   max_num_partial_prefills) fewer than that many requests compute prompt tokens in the step:
   prompts that arrive together then finish one after another, each in a short step, rather
   than all at the end of one long step (time to first token). With LoRA, at most
   max_loras adapters run at once: a request of another adapter waits, and the next one that
   fits is admitted before it (vLLM's rule).

Speculative decoding: a decoding request also checks the draft tokens the DraftPolicy allows
(core/draft_policy.py decides); the scheduler fits them in the budget and the pool, and reports
to the policy what each step checked, accepted and cost.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable

from pagedllm.config import EngineConfig
from pagedllm.core.draft_policy import DraftPolicy
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.core.stop_check import check_stop
from pagedllm.metrics.divergence import DivergenceFinder
from pagedllm.metrics.stats import PrefixCacheStats, SchedulerStats
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.bitmask import DEAD_END, GrammarBitmask, fill_bitmask

# lpm looks this far down the waiting queue, and lets the head be passed over at most
# this many times before it is admitted regardless (bounded wait, no starvation).
LPM_WINDOW = 64
LPM_MAX_SKIPS = 16


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        divergence: DivergenceFinder | None = None,
        draft_policy: DraftPolicy | None = None,
    ) -> None:
        """divergence: told of every prompt admitted with prefix caching on (it reports where
        prompts stop sharing a prefix). draft_policy: how many draft tokens each request checks
        (speculative decoding); None: the default one for config.speculation, if it is on."""
        capacity = kv_cache_manager.block_pool.num_blocks * kv_cache_manager.block_size
        # With this, a request alone always fits, so preempting all others always frees enough.
        assert max_model_len <= capacity, f"max_model_len {max_model_len} exceeds the pool ({capacity} slots)"
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.divergence = divergence
        self.num_disk_hit_tokens = 0
        """Prefix-hit tokens of admitted requests that the disk tier supplied (part of the hits)."""
        self.requests: dict[str, Request] = {}
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []
        self._num_blocks_sent: dict[str, int] = {}
        """Requests the runner holds, and how many of their block ids it has been sent."""
        self._head_skips = 0
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        if draft_policy is None and config.speculation is not None:
            draft_policy = DraftPolicy(config.speculation)
        self.draft_policy = draft_policy

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request (the engine checked its length against max_model_len)."""
        self.requests[request.req_id] = request
        self.waiting[request.req_id] = request
        request.metrics.queued_time = time.monotonic()

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, or a stop string found by the
        detokenizer); their blocks return to the pool at once."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                del self.waiting[req_id]
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def admission_candidates(self) -> list[Request]:
        """The waiting requests the next schedule() may admit, in queue order, as many as there
        are free seats (those asking for prompt logprobs take no prefix hits): the engine has
        the disk tier stage their prefixes first."""
        seats = max(0, self.config.max_num_seqs - len(self.running))
        candidates = itertools.islice(self.waiting.values(), seats)
        return [r for r in candidates if r.sampling_params.prompt_logprobs is None]

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        preempted: list[Request] = []
        token_budget = self._schedule_running(self.config.token_budget, output, preempted)
        if not preempted:
            token_budget = self._schedule_waiting(token_budget, output)
        output.total_num_scheduled_tokens = self.config.token_budget - token_budget
        output.preempted_req_ids = [r.req_id for r in preempted]
        output.kv_transfers = self.kv_cache_manager.take_kv_transfers()
        return output

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """Which tokens the constrained requests that sample this step may take (structured
        output); None when none is constrained. Goes to the runner beside the step, not in it."""
        constrained = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            draft = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            if (
                request.grammar is not None
                and request.num_computed_tokens + num_new - len(draft) == request.num_tokens
            ):
                constrained.append((req_id, request.grammar, draft))
        return fill_bitmask(constrained)

    def _schedule_running(self, token_budget: int, output: SchedulerOutput, preempted: list[Request]) -> int:
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_behind_me = len(self.running) - index - 1
            room = max(1, token_budget - num_behind_me)
            num_new = min(request.num_tokens - request.num_computed_tokens, room)
            draft = []  # a decoding request's draft tokens: as many as fit and its policy allows
            if num_new == 1 and self.draft_policy is not None:
                fit = min(room - 1, self.max_model_len - request.num_tokens)
                draft = self.draft_policy.drafts_to_check(request, fit, len(self.running))
            while self.kv_cache_manager.allocate_slots(request, num_new + len(draft)) is None:
                if draft:  # the pool is short: check no drafts before preempting anyone
                    draft = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return token_budget
            num_new += len(draft)
            self._add_to_output(output, request, num_new, draft)
            token_budget -= num_new
            index += 1
        return token_budget

    def record_step_time(self, num_rows: int, seconds: float) -> None:
        """The engine's timing of a step of num_rows rows (the forward and sampling), with
        speculative decoding on: the draft policy's cost model reads it."""
        if self.draft_policy is not None:
            self.draft_policy.record_step_time(num_rows, seconds)

    def _schedule_waiting(self, token_budget: int, output: SchedulerOutput) -> int:
        prefill_seats = self._prefill_seats()
        while (
            self.waiting
            and token_budget > 0
            and prefill_seats > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request, computed_blocks, num_hit_tokens = self._pick_waiting()
            if request is None:
                break  # every waiting request's adapter waits for a running one's to finish
            num_new = min(request.num_tokens - num_hit_tokens, token_budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks) is None:
                break  # the pool is full: keep arrival order, try again next step
            del self.waiting[request.req_id]
            self._admit(request, num_hit_tokens, self.kv_cache_manager.take_disk_hits(computed_blocks))
            self._add_to_output(output, request, num_new)
            token_budget -= num_new
            prefill_seats -= request.num_tokens - num_hit_tokens > 1  # one left: a decode's share
        return token_budget

    def _prefill_seats(self) -> int:
        """How many more requests may compute prompt tokens this step (max_num_partial_prefills
        less the running ones still behind by more than a token; unbounded without the flag)."""
        limit = self.config.max_num_partial_prefills
        if limit is None:
            return self.config.max_num_seqs
        return limit - sum(r.num_tokens - r.num_computed_tokens > 1 for r in self.running)

    def _pick_waiting(self):
        """The next request to admit, with its cached prefix blocks (None: none may run now)."""
        fits = self._fits_loras()
        head = next((request for request in self.waiting.values() if fits(request)), None)
        if head is None:
            return None, [], 0
        if self.config.scheduling_policy == "fcfs" or self._head_skips >= LPM_MAX_SKIPS:
            self._head_skips = 0
            return (head, *self._cached_prefix(head))
        best = None
        for count, request in enumerate(self.waiting.values()):
            if count == LPM_WINDOW:
                break
            if not fits(request):
                continue
            blocks, num_hit = self._cached_prefix(request)
            if best is None or num_hit > best[2]:
                best = (request, blocks, num_hit)
        assert best is not None
        self._head_skips = 0 if best[0] is head else self._head_skips + 1
        if self.kv_cache_manager.disk is not None:
            # looked up again: a later candidate's lookup may have taken blocks from the disk
            # tier, evicting free cached blocks this one had found
            return (best[0], *self._cached_prefix(best[0]))
        return best

    def _fits_loras(self):
        """Whether a waiting request may run beside the running ones: its adapter is running,
        or fewer than max_loras are."""
        if not self.config.enable_lora:
            return lambda request: True
        running = {request.lora_id for request in self.running} - {0}
        room = len(running) < self.config.max_loras
        return lambda request: request.lora_id == 0 or request.lora_id in running or room

    def _cached_prefix(self, request: Request):
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # every prompt position must be scored by the model
        return self.kv_cache_manager.get_computed_blocks(request)

    def _admit(self, request: Request, num_hit_tokens: int, num_disk_hit_blocks: int = 0) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        self.running.append(request)
        if resumed:
            self.prefix_cache_stats.preempted_recompute_saved += num_hit_tokens
            return
        request.num_cached_tokens = num_hit_tokens
        request.metrics.first_scheduled_time = time.monotonic()
        if self.kv_cache_manager.enable_caching:
            adapter = request.lora_request.lora_name if request.lora_request is not None else None
            self.prefix_cache_stats.record(request.user, request.num_prompt_tokens, num_hit_tokens, adapter)
            self.num_disk_hit_tokens += num_disk_hit_blocks * self.kv_cache_manager.block_size
            if self.divergence is not None:
                self.divergence.observe(request.prompt_token_ids, request.block_hashes)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.draft_policy is not None:
            self.draft_policy.preempted(request.req_id)
        self._num_blocks_sent.pop(request.req_id, None)  # the runner drops it; on resume it is new
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[request.req_id] = request
        self.waiting.move_to_end(request.req_id, last=False)

    def _add_to_output(
        self, output: SchedulerOutput, request: Request, num_new: int, draft: list[int] | None = None
    ) -> None:
        """The runner gets a request whole once (NewRequestData), then only its new blocks (and
        the draft tokens it checks, counted in num_new)."""
        start = request.num_computed_tokens
        self.num_prompt_tokens_computed += max(0, min(start + num_new, request.num_prompt_tokens) - start)
        sent = self._num_blocks_sent.get(request.req_id)
        block_ids = self.kv_cache_manager.get_block_ids(request.req_id, first=sent or 0)
        self._num_blocks_sent[request.req_id] = (sent or 0) + len(block_ids)
        output.num_scheduled_tokens[request.req_id] = num_new
        if draft:
            output.scheduled_spec_decode_tokens[request.req_id] = draft
        if sent is not None:
            output.cached_requests.append(request.req_id, block_ids, start)
            return
        output.new_requests.append(
            NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                eos_token_ids=request.eos_token_ids,
                block_ids=block_ids,
                num_computed_tokens=start,
                lora_request=request.lora_request,
            )
        )

    # ---- after the model ran ---------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request, append sampled tokens, finish stopped requests
        (their blocks are freed now, their seats refilled next step)."""
        now = time.monotonic()
        outputs = []
        any_finished = False
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            error = runner_output.failed.get(req_id)
            if error is not None:
                outputs.append(self._fail(request, error, now))
                any_finished = True
                continue
            pooled = runner_output.pooled.get(req_id)
            if pooled is not None:  # an embedding request: its prompt's end is its output
                request.num_computed_tokens += num_new
                outputs.append(self._finish_pooled(request, pooled, now))
                any_finished = True
                continue
            prompt_logprobs = request.take_new_prompt_logprobs(runner_output.prompt_logprobs.get(req_id))
            token_ids = runner_output.sampled_token_ids.get(req_id)
            draft = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            # the K/V of rejected draft tokens is not kept: the count stops after the accepted ones
            if draft:
                num_new -= len(draft) + 1 - len(token_ids) if token_ids else len(draft)
            request.num_computed_tokens += num_new
            if self.draft_policy is not None:  # a request that ends now is forgotten in _free_request
                proposal = runner_output.spec_token_ids.get(req_id, []) if token_ids else []
                self.draft_policy.record(request, draft or [], len(token_ids or []), proposal)
            if not token_ids:
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_logprobs))
                continue
            output = EngineCoreOutput(req_id, [], [], prompt_logprobs)
            status, grammar_error = None, None
            for token_id in token_ids:  # up to the first that ends the request
                request.append_output_token_id(token_id)
                self.num_generation_tokens += 1
                if request.grammar is not None and not request.grammar.accept(token_id):
                    dead_end = runner_output.grammar_dead_ends.get(req_id) == len(output.new_token_ids)
                    grammar_error = DEAD_END if dead_end else f"token {token_id} does not follow the grammar"
                    break
                output.new_token_ids.append(token_id)
                status = check_stop(request, token_id, self.max_model_len)
                if status is not None:
                    break
            logprobs = runner_output.logprobs.get(req_id)
            if logprobs:
                output.new_logprobs = logprobs[: len(output.new_token_ids)]
            if grammar_error is not None:  # the tokens before the one refused are kept
                failed = self._fail(request, grammar_error, now)
                failed.new_token_ids, failed.new_logprobs = output.new_token_ids, output.new_logprobs
                failed.new_prompt_logprobs = output.new_prompt_logprobs
                outputs.append(failed)
                any_finished = True
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            if status is not None:
                request.status = status
                output.finish_reason = status.finish_reason
                output.stop_reason = request.stop_reason
                self._free_request(request, now)
                any_finished = True
            outputs.append(output)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _finish_pooled(self, request: Request, pooled: list[float], now: float) -> EngineCoreOutput:
        """End an embedding request with its vector; its blocks return at once (its full ones
        stay in the prefix cache, as any request's)."""
        request.status = RequestStatus.FINISHED_STOPPED
        request.metrics.first_token_time = request.metrics.last_token_time = now
        self._free_request(request, now)
        return EngineCoreOutput(request.req_id, [], finish_reason=request.status.finish_reason, pooled=pooled)

    def _fail(self, request: Request, error: str, now: float) -> EngineCoreOutput:
        """End a request whose own part of the step failed; its blocks return at once."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request, now)
        return EngineCoreOutput(request.req_id, [], finish_reason=request.status.finish_reason, error=error)

    def _free_request(self, request: Request, now: float | None = None) -> None:
        self.kv_cache_manager.free(request)
        self._num_blocks_sent.pop(request.req_id, None)
        if self.draft_policy is not None:
            self.draft_policy.finished(request.req_id)
        request.metrics.finished_time = now if now is not None else time.monotonic()
        del self.requests[request.req_id]
        self._finished_req_ids.append(request.req_id)

    # ---- reporting ---------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.usage,
            num_free_blocks=pool.num_free_blocks,
            num_used_slots=sum(r.num_computed_tokens for r in self.running),
            num_cached_blocks=len(pool.cached_block_hash_to_block),
            num_preemptions=self.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            num_disk_hit_tokens=self.num_disk_hit_tokens,
            prefix_cache=self.prefix_cache_stats,
            spec_decode=self.draft_policy.stats if self.draft_policy is not None else None,
            running_lora_adapters=_by_adapter(self.running) if self.config.enable_lora else {},
            waiting_lora_adapters=_by_adapter(self.waiting.values()) if self.config.enable_lora else {},
        )


def _by_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """Requests by the name of the LoRA adapter they run under (those of the base model left out)."""
    return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None))
