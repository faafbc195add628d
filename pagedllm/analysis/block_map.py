"""The KV block map of /dashboard: every block's state, and who holds one block.

Both read the block pool and the requests' block tables (EngineCore.block_tables), which only the
engine thread may touch: the server runs them there through AsyncLLM.call, between two steps, so
a map is never half of one step and half of the next. One character per block keeps a map of
100,000 blocks at 100 kB.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock

FREE = "."
"""No request holds it and it holds no cached prefix."""
CACHED = "c"
"""No request holds it, but a later prompt can still find its prefix by hash; the first evicted
when a new block is needed (LRU)."""
USED = "u"
"""One request holds it."""
SHARED = "s"
"""Several requests hold it (ref_cnt > 1): a prefix hit shared its K/V."""
STATE_NAMES = {FREE: "free", CACHED: "cached", USED: "used", SHARED: "shared"}


def block_state(block: KVCacheBlock) -> str:
    if block.ref_cnt > 1:
        return SHARED
    if block.ref_cnt == 1:
        return USED
    return FREE if block.block_hash is None else CACHED


def block_map(pool: BlockPool) -> dict:
    """`states`: one character per block id; `counts`: blocks by state name."""
    states = "".join(block_state(block) for block in pool.blocks)
    return {
        "num_blocks": pool.num_blocks,
        "states": states,
        "counts": {name: states.count(state) for state, name in STATE_NAMES.items()},
    }


def block_holders(
    pool: BlockPool, block_tables: list[tuple[str, str | None, list[int]]], block_id: int
) -> dict:
    """One block and the requests that hold it: each with its caller and the block's index in
    its block table (tokens index * block_size onward), plus all its block ids, so the page can
    outline them. block_tables: (req_id, caller, block ids) per request, as
    EngineCore.block_tables gives them. Raises IndexError for a block id out of range."""
    if not 0 <= block_id < pool.num_blocks:
        raise IndexError(f"block {block_id} does not exist: the pool has blocks 0-{pool.num_blocks - 1}")
    block = pool.blocks[block_id]
    holders = [
        {"req_id": req_id, "user": user, "index": block_ids.index(block_id), "block_ids": block_ids}
        for req_id, user, block_ids in block_tables
        if block_id in block_ids
    ]
    return {
        "block_id": block_id,
        "state": STATE_NAMES[block_state(block)],
        "ref_cnt": block.ref_cnt,
        "is_cached": block.block_hash is not None,
        "requests": holders,
    }
