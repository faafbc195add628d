"""Block pool and KV cache manager: exact scenarios and hypothesis property tests."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(req_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(),
        eos_token_ids=frozenset(),
        max_tokens=16,
        cache_salt=cache_salt,
    )


def test_new_blocks_come_from_the_head_in_order():
    pool = BlockPool(4, enable_caching=False)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    assert [b.block_id for b in pool.free_block_queue] == [2, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 0]
    pool.check_integrity()


def test_asking_for_more_than_free_raises():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)


def test_manager_allocates_on_demand_and_frees_everything():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    request = make_request("a", list(range(10)))
    new = manager.allocate_slots(request, 10)
    assert [b.block_id for b in new] == [0, 1, 2]  # 10 tokens -> 3 blocks of 4
    request.num_computed_tokens = 10
    request.append_output_token_id(99)
    request.append_output_token_id(98)
    assert manager.allocate_slots(request, 1) == []  # token 11 fits in block 2
    request.num_computed_tokens = 11
    assert [b.block_id for b in manager.allocate_slots(request, 1)] == []  # token 12 still in block 2
    request.num_computed_tokens = 12
    request.append_output_token_id(97)
    assert [b.block_id for b in manager.allocate_slots(request, 1)] == [3]
    manager.free(request)
    assert manager.block_pool.num_free_blocks == 8
    manager.block_pool.check_integrity()


def test_manager_returns_none_and_changes_nothing_when_short():
    manager = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.block_pool.num_free_blocks == 2
    assert manager.get_block_ids("a") == []


# ---- property tests -------------------------------------------------------------------------


class ManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / free sequences, with and without prefix caching, with prompts
    drawn from a few shared prefixes so cached blocks are really shared."""

    @initialize(caching=st.booleans(), num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, caching, num_blocks, block_size):
        self.manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(
        prefix=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5,)]),
        tail=st.lists(st.integers(0, 3), max_size=6),
    )
    def admit(self, prefix, tail):
        self.counter += 1
        request = make_request(f"r{self.counter}", list(prefix) + tail)
        blocks, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit < request.num_tokens
        if self.manager.allocate_slots(request, request.num_tokens - num_hit, blocks) is not None:
            request.num_computed_tokens = request.num_tokens
            self.live[request.req_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        request = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.req_id)))
        request.append_output_token_id(data.draw(st.integers(0, 3)))
        if self.manager.allocate_slots(request, 1) is not None:
            request.num_computed_tokens += 1
        else:  # what the scheduler does: preempt, i.e. free everything
            self.manager.free(request)
            del self.live[request.req_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.manager.free(self.live.pop(req_id))

    @invariant()
    def pool_is_consistent(self):
        pool = self.manager.block_pool
        pool.check_integrity()
        holders: dict[int, int] = {}
        for req_id in self.live:
            for block_id in self.manager.get_block_ids(req_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block} held by {holders.get(block.block_id)}"
            )
            if holders.get(block.block_id, 0) > 1:
                assert pool.enable_caching and block.block_hash is not None, (
                    "only cached blocks may be shared"
                )
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert used + pool.num_free_blocks == pool.num_blocks

    @invariant()
    def block_tables_cover_computed_tokens(self):
        for request in self.live.values():
            num_blocks = len(self.manager.get_block_ids(request.req_id))
            assert num_blocks * self.manager.block_size >= request.num_computed_tokens

    def teardown(self):
        for request in list(self.live.values()):
            self.manager.free(request)
        pool = self.manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        pool.check_integrity()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
