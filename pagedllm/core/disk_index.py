"""DiskIndex: the prefix cache's disk tier as the scheduler sees it: hashes only, no file, no tensor.

    before schedule()   the engine has every rank stage the candidates' chains and calls
                        set_staged() with the hashes all ranks staged (readable now)
    a prefix lookup     `hash in index` (staged), load(block_id, hash): a load recorded
    a pool eviction     save(block_id, hash): a save recorded
    schedule()'s end    take_transfers(): the step's KVTransfers, which every rank's mover
                        (worker/kv_offload/) does before the step's forward

The copies happen later, in the step, in order: saves, then loads. So a block loaded and then
evicted within one step records neither (its bytes never arrived, and its hash is on disk).
"""

from __future__ import annotations

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.outputs import KVTransfers


class DiskIndex:
    def __init__(self) -> None:
        self._staged: set[BlockHash] = set()
        self._saves: list[tuple[int, BlockHash]] = []
        self._loads: dict[int, BlockHash] = {}  # block_id -> hash, this step's

    def set_staged(self, block_hashes: set[BlockHash]) -> None:
        """What every rank's disk tier has read and checked: loadable until the next call."""
        self._staged = block_hashes

    @property
    def has_staged(self) -> bool:
        return bool(self._staged)

    def __contains__(self, block_hash: BlockHash) -> bool:
        """Staged: a lookup may take it now."""
        return block_hash in self._staged

    def load(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record a load of a staged block into the fresh block `block_id`; False if not staged
        (each staged block loads once)."""
        if block_hash not in self._staged:
            return False
        self._staged.discard(block_hash)
        self._loads[block_id] = block_hash
        return True

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        """Record a save of a cached block the pool is evicting (its bytes still in `block_id`)."""
        if self._loads.get(block_id) == block_hash:
            del self._loads[block_id]  # loaded this step and evicted already: nothing to move
            return
        self._saves.append((block_id, block_hash))

    def take_transfers(self) -> KVTransfers | None:
        """The copies recorded since the last call (None: none), in the order they must run."""
        if not self._saves and not self._loads:
            return None
        transfers = KVTransfers(saves=self._saves, loads=list(self._loads.items()))
        self._saves, self._loads = [], {}
        return transfers
