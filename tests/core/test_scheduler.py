"""Scheduler policy with a fake model: continuous batching, chunked prefill, preemption."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.request import RequestStatus
from pagedllm.worker.input_batch import InputBatch

from ..helpers import EOS, fake_run, make_request, make_scheduler, step


def test_waiting_requests_are_admitted_in_arrival_order_up_to_the_seats():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 4))
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["a", "b"]
    assert list(scheduler.waiting) == ["c"]


def test_long_prompt_is_chunked_and_decodes_keep_running():
    scheduler = make_scheduler(budget=16, max_num_seqs=4)
    scheduler.add_request(make_request("short", 4))
    step(scheduler)  # short prefilled and sampled its first token
    scheduler.add_request(make_request("long", 40))
    chunks = []
    while scheduler.requests["long"].num_output_tokens == 0:
        output, _ = step(scheduler)
        by_id = output.num_scheduled_tokens
        assert by_id["short"] == 1, "the decode must get its token every step"
        chunks.append(by_id["long"])
        assert output.total_num_scheduled_tokens <= 16
    assert chunks == [15, 15, 10]


def test_partial_prefill_limit_gives_prompts_arriving_together_their_first_tokens_in_turn():
    scheduler = make_scheduler(budget=64, max_num_partial_prefills=1)
    for name in "abc":
        scheduler.add_request(make_request(name, 10))
    firsts = []
    for _ in range(3):
        output, outputs = step(scheduler)
        prefilling = [r for r, n in output.num_scheduled_tokens.items() if n > 1]
        assert len(prefilling) == 1
        firsts += [o.req_id for o in outputs if len(scheduler.requests[o.req_id].output_token_ids) == 1]
    assert firsts == ["a", "b", "c"], "one prompt per step, in arrival order, decodes beside it"
    assert output.num_scheduled_tokens == {"a": 1, "b": 1, "c": 10}


def test_partial_prefill_limit_counts_a_long_prompt_still_being_chunked():
    scheduler = make_scheduler(budget=16, max_num_partial_prefills=2)
    for name, length in [("long", 40), ("x", 6), ("y", 6)]:
        scheduler.add_request(make_request(name, length))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 16}, "the budget is spent before x is admitted"
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 16}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 8, "x": 6}, "x is the second prefill: y waits"
    assert list(scheduler.waiting) == ["y"]
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 1, "x": 1, "y": 6}


def test_a_prompt_whose_prefix_is_cached_to_its_last_token_takes_no_prefill_seat():
    scheduler = make_scheduler(budget=64, caching=True, max_num_partial_prefills=1)
    scheduler.add_request(make_request("first", 9))
    step(scheduler)
    scheduler.add_request(make_request("same", 9))  # 2 full blocks of 4 cached: 1 token to compute
    scheduler.add_request(make_request("other", 9, first_token=2))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"first": 1, "same": 1, "other": 9}


def test_finished_request_frees_its_blocks_in_the_same_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, max_tokens=1))
    _, outputs = step(scheduler)
    assert outputs[0].finish_reason == "length"
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 64
    assert not scheduler.has_unfinished_requests()


def test_eos_stops_unless_min_tokens_or_ignore_eos():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("plain", 3, max_tokens=4))
    scheduler.add_request(make_request("min_tokens", 3, max_tokens=4, min_tokens=2))
    scheduler.add_request(make_request("ignore_eos", 3, max_tokens=4, ignore_eos=True))
    num_tokens: dict[str, int] = {}
    finish_reasons: dict[str, str] = {}
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, token=EOS)
        for o in outputs:
            num_tokens[o.req_id] = num_tokens.get(o.req_id, 0) + len(o.new_token_ids)
            if o.finish_reason:
                finish_reasons[o.req_id] = o.finish_reason
    assert finish_reasons == {"plain": "stop", "min_tokens": "stop", "ignore_eos": "length"}
    # as vLLM checks it: EOS ends a request once it has min_tokens outputs (the EOS among them)
    assert num_tokens == {"plain": 1, "min_tokens": 2, "ignore_eos": 4}


def test_pool_exhaustion_preempts_the_newest_running_request():
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    scheduler.add_request(make_request("old", 8, max_tokens=20))
    scheduler.add_request(make_request("new", 8, max_tokens=20))
    step(scheduler)  # both prefilled: 2 blocks each, 2 free
    preempted = []
    for _ in range(12):
        output, _ = step(scheduler)
        preempted += output.preempted_req_ids
        if preempted:
            break
    assert preempted == ["new"]
    new = scheduler.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert next(iter(scheduler.waiting)) == "new"
    while scheduler.has_unfinished_requests():  # and everyone still finishes
        step(scheduler)
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 6


def test_abort_frees_blocks_of_waiting_and_running_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", 6))
    scheduler.add_request(make_request("wait", 6))
    step(scheduler)
    scheduler.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 64


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort. Without prefix caching no block may ever have two owners."""

    @initialize(
        num_blocks=st.integers(8, 40),
        block_size=st.sampled_from([2, 4, 8]),
        max_num_seqs=st.integers(1, 6),
        extra_budget=st.integers(0, 24),
        speculative=st.booleans(),
        partial_prefills=st.none() | st.integers(1, 3),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, extra_budget, speculative, partial_prefills):
        # every request must fit the pool alone (the engine checks this against max_model_len)
        self.max_len = num_blocks * block_size
        self.scheduler = make_scheduler(
            num_blocks,
            block_size,
            max_num_seqs,
            max_num_seqs + extra_budget,
            caching=False,
            max_model_len=self.max_len,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4} if speculative else None,
            max_num_partial_prefills=partial_prefills,
        )
        self.counter = 0
        self.finished: set[str] = set()
        # the runner's side of the seam: its batch must always agree with the scheduler's requests
        self.batch = InputBatch(
            max_num_seqs, self.max_len, -(-self.max_len // block_size), 10, torch.device("cpu")
        )

    @rule(num_prompt=st.integers(1, 30), max_tokens=st.integers(1, 12))
    def add(self, num_prompt, max_tokens):
        if num_prompt + max_tokens > self.max_len:
            return
        self.counter += 1
        self.scheduler.add_request(make_request(f"r{self.counter}", num_prompt, max_tokens))

    @rule(
        token=st.integers(0, 9),
        num_accepted=st.integers(0, 4),
        next_draft=st.lists(st.integers(0, 9), max_size=4),
    )
    def step(self, token, num_accepted, next_draft):
        """With speculation on, the runner proposes `next_draft` (ignored without) and accepts
        the first num_accepted of each request's draft tokens."""
        running_before = list(self.scheduler.running)
        output = self.scheduler.schedule()
        self.check_the_runner_batch_agrees(output)
        runner_output = fake_run(self.scheduler, output, token, num_accepted, next_draft)
        sampled = runner_output.sampled_token_ids
        if sampled:  # the runner records its samples
            self.batch.append_tokens(
                [self.batch.row_of[req_id] for req_id in sampled], list(sampled.values())
            )
        outputs = self.scheduler.update_from_output(output, runner_output)
        assert output.total_num_scheduled_tokens <= self.scheduler.config.token_budget
        if not output.preempted_req_ids:
            for request in running_before:
                assert request.req_id in output.num_scheduled_tokens, (
                    "a running request was skipped without preemption"
                )
        assert all(n >= 1 for n in output.num_scheduled_tokens.values())
        limit = self.scheduler.config.max_num_partial_prefills
        if limit is not None:
            drafts = output.scheduled_spec_decode_tokens
            prefills = [r for r, n in output.num_scheduled_tokens.items() if n > 1 and r not in drafts]
            assert len(prefills) <= limit, "more prompts computed in a step than max_num_partial_prefills"
        self.finished |= {o.req_id for o in outputs if o.finish_reason}

    def check_the_runner_batch_agrees(self, output) -> None:
        """Sent only deltas, the runner's input batch holds the tokens and the blocks the
        scheduler's own requests say (through preemptions, resumes and aborts)."""
        self.batch.update(output)
        manager = self.scheduler.kv_cache_manager
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            row = self.batch.row_of[req_id]
            start = int(self.batch.num_computed_tokens[row])
            assert start == request.num_computed_tokens
            assert int(self.batch.num_tokens[row]) == request.num_tokens
            draft = output.scheduled_spec_decode_tokens.get(req_id, [])
            assert (
                self.batch.token_ids[row, start : start + num_new].tolist()
                == (request.all_token_ids + draft)[start : start + num_new]
            )
            block_ids = manager.get_block_ids(request.req_id)
            assert self.batch.block_table[row, : len(block_ids)].tolist() == block_ids
        assert set(self.batch.row_of) == {r.req_id for r in self.scheduler.running}

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.scheduler.requests)
        self.scheduler.finish_requests([data.draw(st.sampled_from(live))], RequestStatus.FINISHED_ABORTED)

    @invariant()
    def blocks_have_one_owner(self):
        manager = self.scheduler.kv_cache_manager
        manager.block_pool.check_integrity()
        owners: dict[int, str] = {}
        for request in self.scheduler.running:
            for block_id in manager.get_block_ids(request.req_id):
                assert block_id not in owners, (
                    f"block {block_id} owned by {owners[block_id]} and {request.req_id}"
                )
                owners[block_id] = request.req_id
        for request in self.scheduler.waiting.values():
            assert manager.get_block_ids(request.req_id) == [], "a waiting request holds blocks"
        assert len(owners) + manager.block_pool.num_free_blocks == manager.block_pool.num_blocks

    def teardown(self):
        for _ in range(2000):  # drain: everything must finish, nothing may deadlock
            if not self.scheduler.has_unfinished_requests():
                break
            step(self.scheduler, 5)
        assert not self.scheduler.has_unfinished_requests(), "scheduler did not drain"
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
