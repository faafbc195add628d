"""Prefix caching: hit accounting, equivalence with caching off, LRU eviction, salts, reset. The
engines run the mechanism model (helpers.save_mechanism_model): caching is compared with our own
path without it."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus

from ..helpers import TEST_ENGINE_ARGS, fake_run, make_scheduler, save_tiny_model, step

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def make_request(req_id: str, token_ids: list[int], max_tokens: int = 8) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=frozenset({0}),
        max_tokens=max_tokens,
    )


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


@pytest.fixture(scope="module")
def cached_llm(mechanism_args):
    return LLM(**mechanism_args)


@pytest.fixture
def fresh(cached_llm):
    cached_llm.reset_prefix_cache()
    return cached_llm


def cached_tokens(llm, prompts, params=GREEDY, **kwargs) -> list[int]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kwargs)
    return [o.num_cached_tokens for o in outputs]


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_shared_prefix_hits_after_the_first_request(fresh):
    prefix = token_prompt(1, 4 * BLOCK)
    prompts = [prefix + token_prompt(100 + i, 10) for i in range(4)]
    assert cached_tokens(fresh, prompts[:1]) == [0]
    assert cached_tokens(fresh, prompts[1:2]) == [4 * BLOCK]
    # admitted together in one step: later requests hit blocks the first fills in that step
    assert cached_tokens(fresh, prompts[2:]) == [4 * BLOCK, 4 * BLOCK]


def test_requests_admitted_together_share_their_common_prefix(fresh):
    prefix = token_prompt(2, 3 * BLOCK)
    prompts = [prefix + token_prompt(200 + i, 7) for i in range(4)]
    assert cached_tokens(fresh, prompts) == [0, 3 * BLOCK, 3 * BLOCK, 3 * BLOCK]


def test_longer_prompt_hits_the_full_blocks_of_a_shorter_one(fresh):
    base = token_prompt(3, 5 * BLOCK)
    assert cached_tokens(fresh, [base]) == [0]
    assert cached_tokens(fresh, [base + token_prompt(4, 5)]) == [5 * BLOCK]
    # the same prompt again: all but the last block, so there are logits to sample from
    assert cached_tokens(fresh, [base]) == [4 * BLOCK]


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_cache_salt_isolates_tenants(fresh):
    engine = fresh.llm_engine
    prompt = token_prompt(5, 4 * BLOCK + 3)

    def run(salt):
        engine.add_request(
            f"salt-{salt}-{random.random()}", {"prompt_token_ids": prompt}, GREEDY, cache_salt=salt
        )
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        return outputs[0].num_cached_tokens

    assert run("tenant-a") == 0
    assert run("tenant-a") == 4 * BLOCK
    assert run("tenant-b") == 0
    assert run(None) == 0


@pytest.mark.slow
def test_decode_blocks_are_cached_so_the_next_turn_hits_the_answer(fresh):
    turn1 = token_prompt(6, 2 * BLOCK + 5)
    answer = (
        fresh.generate(
            {"prompt_token_ids": turn1},
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    turn2 = turn1 + answer + token_prompt(7, 9)
    # everything computed in turn 1 (all but its last sampled token), whole blocks only
    expected = (len(turn1) + len(answer) - 1) // BLOCK * BLOCK
    assert cached_tokens(fresh, [turn2]) == [expected]


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_reset_prefix_cache_drops_free_cached_blocks(fresh):
    prompt = token_prompt(8, 3 * BLOCK + 2)
    cached_tokens(fresh, [prompt])
    assert fresh.reset_prefix_cache() > 0
    assert cached_tokens(fresh, [prompt]) == [0]


@pytest.mark.slow
def test_hit_rate_counters(fresh):
    stats_before = fresh.llm_engine.get_stats().prefix_cache
    queries, hits = stats_before.queries, stats_before.hits
    prefix = token_prompt(9, 4 * BLOCK)
    prompts = [prefix + token_prompt(900 + i, 6) for i in range(3)]
    cached_tokens(fresh, prompts[:1])
    cached_tokens(fresh, prompts[1:])
    stats = fresh.llm_engine.get_stats().prefix_cache
    assert stats.queries - queries == 3 * len(prompts[0])
    assert stats.hits - hits == 2 * 4 * BLOCK


# ---- equivalence: the same greedy outputs with caching off --------------------------------------


@pytest.fixture(scope="module")
def uncached(mechanism_args):
    return LLM(**mechanism_args, enable_prefix_caching=False)


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_shared_prefix_outputs_equal_caching_off(fresh, uncached):
    preamble = "You are a careful assistant. Use only the reference below.\n\nReference:\n" + (
        "Paged attention keeps the KV cache in blocks so memory is allocated on demand. " * 12
    )
    prompts = [preamble + f"\nQuestion {i}: what is point number {i} of the reference?" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    cached = fresh.generate(prompts, params, use_tqdm=False)
    plain = uncached.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert all(o.num_cached_tokens > 100 for o in cached[1:])
    assert all(o.num_cached_tokens == 0 for o in plain)


@pytest.mark.slow  # four turns, twice
def test_four_turn_conversation_equals_caching_off(fresh, uncached):
    questions = ["What is a KV cache?", "Why use blocks?", "What happens when blocks run out?", "Summarize."]
    params = SamplingParams(temperature=0.0, max_tokens=16)

    def converse(llm):
        messages, answers, hits = [{"role": "system", "content": "Answer briefly."}], [], []
        for question in questions:
            messages.append({"role": "user", "content": question})
            output = llm.chat(messages, params, use_tqdm=False)[0]
            answers.append(output.outputs[0].token_ids)
            hits.append(output.num_cached_tokens)
            messages.append({"role": "assistant", "content": output.outputs[0].text})
        return answers, hits

    cached_answers, hits = converse(fresh)
    plain_answers, _ = converse(uncached)
    assert cached_answers == plain_answers
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_eviction_under_pressure_keeps_outputs_correct(mechanism_args, uncached):
    small = LLM(**{**mechanism_args, "max_model_len": 256}, num_gpu_blocks_override=24)
    prefixes = [token_prompt(50 + i, 3 * BLOCK) for i in range(3)]
    prompts = [prefixes[i % 3] + token_prompt(60 + i, 5 + i) for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = uncached.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    pool = small.llm_engine.core.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks and pool.num_evictions > 0


# ---- mechanism scenarios ------------------------------------------------------------------------


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a, b = make_request("a", [1, 2, 3, 4]), make_request("b", [5, 6, 7, 8])
    for request in (a, b):
        manager.allocate_slots(request, 4)
        request.num_computed_tokens = 4
    manager.free(a)  # a's tail block first, then its head
    manager.free(b)
    order = [blk.block_id for blk in manager.block_pool.free_block_queue]
    assert order == [4, 5, 1, 0, 3, 2]  # never-used blocks first, then LRU among cached ones
    c = make_request("c", [9, 9, 9, 9, 9, 9])
    manager.allocate_slots(c, 6)  # takes 4, 5 (empty) and evicts block 1 (a's tail)
    assert manager.get_block_ids("c") == [4, 5, 1]
    hit_blocks, hit_tokens = manager.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 0]))
    assert [blk.block_id for blk in hit_blocks] == [0] and hit_tokens == 2
    manager.block_pool.check_integrity()


def test_a_hit_revives_a_block_from_the_middle_of_the_free_queue():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    manager.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    manager.free(a)
    b = make_request("b", [1, 2, 3, 4, 7])
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4
    manager.allocate_slots(b, 1, blocks)
    assert [blk.ref_cnt for blk in blocks] == [1, 1]
    assert manager.block_pool.num_free_blocks == 1  # 4 - 2 revived - 1 new
    manager.block_pool.check_integrity()


def test_resumed_preempted_request_is_not_counted_as_a_hit():
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=64, caching=True)
    scheduler.add_request(make_request("old", list(range(1, 9)), max_tokens=14))
    scheduler.add_request(make_request("new", list(range(20, 28)), max_tokens=14))
    step(scheduler)
    preempted = False
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        preempted |= bool(output.preempted_req_ids)
    stats = scheduler.prefix_cache_stats
    assert preempted
    assert stats.hits == 0 and stats.queries == 16
    assert stats.preempted_recompute_saved > 0


def test_lpm_prefers_a_cached_prefix_without_starving_the_head():
    scheduler = make_scheduler(
        num_blocks=64, block_size=4, max_num_seqs=1, budget=64, caching=True, policy="lpm"
    )
    shared = list(range(1, 13))
    scheduler.add_request(make_request("warm", [*shared, 50], max_tokens=1))
    step(scheduler)  # caches the shared blocks
    scheduler.add_request(make_request("cold", list(range(100, 113)), max_tokens=1))
    scheduler.add_request(make_request("hot", [*shared, 60], max_tokens=1))
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["hot"]
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["cold"]


class CachingSchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / stop / fail with shared prefixes and a small pool (so requests
    are preempted): no block may be both free and referenced, ref counts equal holders, and
    everything drains back to the pool, however requests end."""

    @initialize(num_blocks=st.integers(10, 30), max_num_seqs=st.integers(1, 5))
    def setup(self, num_blocks, max_num_seqs):
        self.scheduler = make_scheduler(num_blocks, 4, max_num_seqs, max_num_seqs + 16, caching=True)
        self.max_len = num_blocks * 4
        self.counter = 0

    @rule(
        prefix=st.sampled_from([(1,) * 8, (2,) * 12, (1,) * 8 + (3,) * 4]),
        tail=st.integers(1, 9),
        max_tokens=st.integers(1, 10),
    )
    def add(self, prefix, tail, max_tokens):
        prompt = list(prefix) + [7] * tail
        if len(prompt) + max_tokens > self.max_len:
            return
        self.counter += 1
        self.scheduler.add_request(make_request(f"r{self.counter}", prompt, max_tokens))

    @rule(token=st.integers(1, 4))
    def step(self, token):
        step(self.scheduler, token)

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(
        data=st.data(),
        status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]),
    )
    def end_from_outside(self, data, status):
        """An abort (a client left) or a stop string (found by the detokenizer)."""
        req_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests([req_id], status)

    @rule(data=st.data())
    def step_where_one_request_fails(self, data):
        """The runner reports one scheduled request's own work failed (its sampling, say)."""
        output = self.scheduler.schedule()
        if not output.num_scheduled_tokens:
            return
        failed = data.draw(st.sampled_from(list(output.num_scheduled_tokens)))
        runner_output = fake_run(self.scheduler, output, 2)
        runner_output.sampled_token_ids.pop(failed, None)
        runner_output.failed[failed] = "RuntimeError: injected"
        outputs = self.scheduler.update_from_output(output, runner_output)
        assert [o.finish_reason for o in outputs if o.req_id == failed] == ["error"]
        assert failed not in self.scheduler.requests

    @invariant()
    def ref_counts_equal_holders(self):
        manager = self.scheduler.kv_cache_manager
        manager.block_pool.check_integrity()
        holders: dict[int, int] = {}
        for request in self.scheduler.running:
            for block_id in manager.get_block_ids(request.req_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in manager.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)

    def teardown(self):
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests():
                break
            step(self.scheduler, 1)
        pool = self.scheduler.kv_cache_manager.block_pool
        assert not self.scheduler.has_unfinished_requests()
        assert pool.num_free_blocks == pool.num_blocks
        pool.check_integrity()


TestCachingSchedulerMachine = CachingSchedulerMachine.TestCase
TestCachingSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_hit_rate_by_caller_and_prompt_length(fresh):
    engine = fresh.llm_engine
    prefix = token_prompt(11, 10 * BLOCK)
    for i, user in enumerate(["alice", "bob", "alice"]):
        engine.add_request(
            f"u{i}", {"prompt_token_ids": prefix + token_prompt(1100 + i, 4)}, GREEDY, user=user
        )
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.get_stats().prefix_cache
    assert stats.by_user["alice"].requests >= 2 and stats.by_user["alice"].hits >= 10 * BLOCK
    assert stats.by_user["bob"].hits == 10 * BLOCK and stats.by_user["bob"].queries == 10 * BLOCK + 4
    assert stats.by_prompt_length["128-511"].hits >= 20 * BLOCK


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_sliding_window_layers_give_the_same_tokens_cached_chunked_and_batched(tmp_path):
    """A Gemma 3 whose 8-key windows slide well inside these prompts: prompts sharing a 3-block
    prefix, served together with prefix caching and 16-token prefill chunks, give each one's
    tokens served alone, cold, in one chunk (float32)."""
    save_tiny_model("gemma3-window", tmp_path)
    prefix = token_prompt(70, 3 * BLOCK)
    prompts = [{"prompt_token_ids": prefix + token_prompt(80 + i, 5 + 3 * i)} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine_args = {**TEST_ENGINE_ARGS, "max_model_len": 256}
    crowded = LLM(str(tmp_path), **engine_args, max_num_batched_tokens=16, max_num_seqs=16)
    together = crowded.generate(prompts, params, use_tqdm=False)
    assert sum(output.num_cached_tokens for output in together) > 0  # the prefix was shared
    alone = LLM(str(tmp_path), **engine_args, enable_prefix_caching=False)
    for prompt, output in zip(prompts, together, strict=True):
        expected = alone.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert output.outputs[0].token_ids == expected
