"""The dashboard's KV block map: each block's state and who holds it, on a tiny pool."""

from __future__ import annotations

import pytest

from pagedllm.analysis.block_map import block_holders, block_map
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(req_id: str, token_ids: list[int], user: str) -> Request:
    return Request(req_id, token_ids, SamplingParams(), frozenset(), max_tokens=4, user=user)


def test_states_follow_hits_and_frees():
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 10)), "alice")  # 2 full blocks + 1 token
    b = make_request("b", [*range(1, 9), 20, 21], "bob")  # a's 2 full blocks, then its own
    manager.allocate_slots(a, a.num_tokens)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    manager.allocate_slots(b, b.num_tokens - num_hit_tokens, hits)
    pool = manager.block_pool
    assert block_map(pool) == {
        "num_blocks": 6,
        "states": "ssuu..",
        "counts": {"free": 2, "cached": 0, "used": 2, "shared": 2},
    }
    users = {"a": "alice", "b": "bob"}

    def tables():
        return [(req_id, users[req_id], ids) for req_id, ids in manager.block_tables().items()]

    assert block_holders(pool, tables(), 1) == {
        "block_id": 1,
        "state": "shared",
        "ref_cnt": 2,
        "is_cached": True,
        "requests": [
            {"req_id": "a", "user": "alice", "index": 1, "block_ids": [0, 1, 2]},
            {"req_id": "b", "user": "bob", "index": 1, "block_ids": [0, 1, 3]},
        ],
    }
    manager.free(a)
    assert block_map(pool)["states"] == "uu.u.."  # a's partial last block held no cached prefix
    manager.free(b)
    assert block_map(pool)["states"] == "cc...."  # nobody holds them, a later prompt can still hit
    assert block_holders(pool, tables(), 0)["requests"] == []
    with pytest.raises(IndexError, match="blocks 0-5"):
        block_holders(pool, tables(), 6)
