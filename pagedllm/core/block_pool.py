"""BlockPool: the KV cache blocks as bookkeeping: ref counts, the free queue, the hash map.

Invariants (checked by `check_integrity`):
- a block is in the free queue exactly when its ref_cnt is 0;
- free + in use = total;
- every hash in the map names a block that carries that hash, and no block carries a hash
  that is not in the map.

The free queue is also the eviction order. A freed block that holds a cached prefix goes
to the tail and keeps its hash, so a later request can still find it; new blocks are taken
from the head, and a cached block taken from there is evicted (its hash dropped). So the
least recently freed cached block is evicted first (LRU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedllm.core.block_hash import BlockHash


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's K and V tensors."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None when the block is not in it (or at an end).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove from the middle
    (a prefix hit revives a cached block wherever it sits in the queue)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep the link code branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None


class BlockPool:
    """All `num_blocks` blocks; hands them out, takes them back, remembers cached prefixes."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        """Told (block id, hash) before a cached block is taken for new use: its K/V is still
        there (the disk tier copies it out). Not told of reset_prefix_cache's drops."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached-but-free ones included (they can be evicted)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); cached-but-free blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks found for a new request."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail
        in the given order (so the first given is the first evicted)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed twice"
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a block that just became full findable by its hash. If another block already
        holds the same content, the map keeps that one; this block stays private."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached-but-free block. Returns how many were dropped."""
        dropped = 0
        for block in self.free_block_queue:
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        self.num_evictions -= dropped  # a reset is not cache pressure
        return dropped

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def check_integrity(self) -> None:
        """Assert the pool's invariants; for tests and debug runs."""
        free = list(self.free_block_queue)
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.num_free_blocks, "free queue has duplicates"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref_cnt"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"{block} free-queue membership disagrees with its ref_cnt"
            )
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{block} carries a hash the map does not give back"
                )
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"map entry points to {block} with another hash"
