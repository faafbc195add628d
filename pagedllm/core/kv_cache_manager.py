"""KVCacheManager: the two questions the scheduler asks about KV memory.

1. What prefix of this request is already cached?        -> get_computed_blocks
2. Can these new tokens get slots? (then take them)      -> allocate_slots, else None

It also frees a request's blocks. It decides nothing: who runs, who waits and who is
preempted is the scheduler's business; which physical block is which is the pool's.
"""

from __future__ import annotations

from itertools import takewhile

from pagedllm.core.block_hash import BlockHash, extend_block_hashes, get_hash_function
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.disk_index import DiskIndex
from pagedllm.core.outputs import KVTransfers
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_algo: str = "sha256",
        disk: DiskIndex | None = None,
    ) -> None:
        """`disk`: the disk tier's index (evicted cached blocks are saved to it, lookups load
        from it); None: no disk tier."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.disk = disk if enable_caching else None
        if self.disk is not None:
            self.block_pool.on_evict = self._on_evict
        self.num_disk_hit_blocks = 0
        """Blocks a lookup brought back from the disk tier."""
        self._from_disk: set[int] = set()
        """Blocks brought back from disk that no admitted request has taken yet."""
        self._hash_fn = get_hash_function(hash_algo)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the hash map.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of `request`.

        At least the last token is always left to compute, so the step that finishes the
        prompt has logits to sample from.

        Returns:
            The cached blocks (not yet referenced) and the number of tokens they hold.
        """
        if not self.enable_caching:
            return [], 0
        blocks, uncached = self._cached_prefix(request)
        if self.disk is not None and uncached:
            blocks += self._bring_back(uncached, blocks)
        return blocks, len(blocks) * self.block_size

    def uncached_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes a lookup of `request` would ask the disk tier for now: those of its
        hittable blocks after the run cached in memory (the engine has them staged)."""
        if not self.enable_caching:
            return []
        return self._cached_prefix(request)[1]

    def _cached_prefix(self, request: Request) -> tuple[list[KVCacheBlock], list[BlockHash]]:
        """The leading blocks of `request` cached in memory, and the hashes of its hittable
        blocks after them (at least the last token is left to compute)."""
        self._hash_request(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, hashes[len(blocks) :]

    def _bring_back(self, hashes: list[BlockHash], hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The leading `hashes` the disk tier holds, each loaded into a fresh block that becomes an
        ordinary cached block (free, findable by its hash). The memory `hits` before them are held
        meanwhile, so taking fresh blocks cannot evict them."""
        assert self.disk is not None
        on_disk = list(takewhile(self.disk.__contains__, hashes))
        if not on_disk:
            return []
        self.block_pool.touch(hits)
        loaded: list[KVCacheBlock] = []
        try:
            for block_hash in on_disk:
                if self.block_pool.num_free_blocks == 0:
                    break
                [block] = self.block_pool.get_new_blocks(1)
                if not self.disk.load(block.block_id, block_hash):
                    self.block_pool.free_blocks([block])
                    break
                self.block_pool.cache_full_block(block, block_hash)
                loaded.append(block)
        finally:
            self.block_pool.free_blocks(reversed(loaded))  # the chain's tail is evicted first
            self.block_pool.free_blocks(reversed(hits))
        self.num_disk_hit_blocks += len(loaded)
        self._from_disk.update(block.block_id for block in loaded)
        return loaded

    def take_disk_hits(self, blocks: list[KVCacheBlock]) -> int:
        """How many of an admitted request's hit blocks came from the disk tier (counted once)."""
        taken = [block.block_id for block in blocks if block.block_id in self._from_disk]
        self._from_disk.difference_update(taken)
        return len(taken)

    def _on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        assert self.disk is not None
        self._from_disk.discard(block_id)
        self.disk.save(block_id, block_hash)

    def take_kv_transfers(self) -> KVTransfers | None:
        """The disk tier's copies the lookups and evictions since the last call recorded."""
        return self.disk.take_transfers() if self.disk is not None else None

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """Every cached block as (block_id, hash): what a graceful shutdown saves."""
        return [(block.block_id, h) for h, block in self.block_pool.cached_block_hash_to_block.items()]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Args:
            num_new_tokens: tokens to compute this step, after the cached ones.
            new_computed_blocks: prefix-cache hits for a request being admitted; they are
                referenced and become the head of its block table.

        Returns:
            The newly taken blocks, or None (and no change at all) when the pool is short.
        """
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        num_computed_tokens = request.num_computed_tokens + len(computed) * self.block_size
        num_required = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(computed))
        # Hit blocks nobody holds sit in the free queue: touching them removes them from it.
        num_revived = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_revived:
            if not req_blocks:
                del self.req_to_blocks[request.req_id]
            return None

        if computed:
            self.block_pool.touch(computed)
            req_blocks.extend(computed)
            self._num_cached_blocks[request.req_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks. Tail blocks go first into the free queue, so they are
        evicted before the shared prefix blocks at the head of the request."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str, first: int = 0) -> list[int]:
        """The request's block ids from its `first`-th block on (a running request's blocks are
        only ever appended, so the runner can be sent the new ones alone)."""
        return [block.block_id for block in self.req_to_blocks.get(req_id, [])[first:]]

    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block ids, in block-table order (a copy, for the dashboard's map)."""
        return {req_id: [block.block_id for block in blocks] for req_id, blocks in self.req_to_blocks.items()}

    def hash_prompt(self, request: Request) -> None:
        """Hash the full blocks of a new request's prompt (a no-op without prefix caching)."""
        if self.enable_caching:
            self._hash_request(request)

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_prefix_cache()

    def _hash_request(self, request: Request) -> None:
        extend_block_hashes(request, self.block_size, self._hash_fn)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that `num_tokens` tokens fill. Their K/V is written in this
        step's forward pass, before any later step can read them through a hit."""
        num_full_blocks = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.req_id, 0)
        if num_full_blocks <= start:
            return
        self._hash_request(request)
        blocks = self.req_to_blocks[request.req_id]
        hashes: list[BlockHash] = request.block_hashes
        for index in range(start, num_full_blocks):
            self.block_pool.cache_full_block(blocks[index], hashes[index])
        self._num_cached_blocks[request.req_id] = num_full_blocks
