"""KVOffloadMover: the worker side of the disk tier, one per rank. It owns this rank's
DiskKVStore and copies blocks between it and this rank's KV cache tensors (its share of the KV
heads, under its own fingerprint), as the scheduler's KVTransfers say:

    start of a step    saves first (copied out: a block evicted this step may be reused by this
                       step's forward), then loads (staged payloads copied in), then the forward
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import KVTransfers
from pagedllm.worker.kv_cache import KVCachePlan
from pagedllm.worker.kv_offload.files import fingerprint
from pagedllm.worker.kv_offload.store import DiskKVStore

logger = logging.getLogger(__name__)


def open_mover(
    config: EngineConfig,
    model_folder: Path,
    dtype: torch.dtype,
    plan: KVCachePlan,
    kv_caches: Sequence[tuple[torch.Tensor, ...]],
    rank: tuple[int, int] | None,
) -> KVOffloadMover:
    """One rank's disk tier, started: DIR/<fingerprint>/ opened (created if missing, served
    read-only if it cannot be written), its files indexed, its threads running.

    Args:
        rank: (rank, number of ranks) with tensor parallelism: the fingerprint names them, as
            each rank stores its share of the KV heads; None keeps the single-rank fingerprint.

    Raises:
        ValueError: naming --kv-offload-dir, when the directory cannot be created.
    """
    assert config.kv_offload_dir is not None
    spec = plan.spec
    layout: list[object] = [
        dtype,
        spec.cache_dtype,
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        config.prefix_caching_hash_algo,
    ]
    if rank is not None:
        layout += ["tensor parallel rank", *rank]
    store = DiskKVStore(
        config.kv_offload_dir,
        int(config.kv_offload_max_bytes),
        fingerprint(model_folder, layout),
        KVOffloadMover.payload_nbytes(kv_caches),
        # one longest request's prefix in memory between its read and its load
        max_staged_blocks=min(plan.num_blocks, spec.blocks_per_sequence(plan.max_model_len)),
    )
    mover = KVOffloadMover(store, kv_caches)
    mover.start()
    return mover


class KVOffloadMover:
    def __init__(self, store: DiskKVStore, kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        """`kv_caches`: per layer, its cache tensors, each [num_blocks, ...] (K, V, scales)."""
        self.store = store
        self.kv_caches = kv_caches

    @staticmethod
    def payload_nbytes(kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> int:
        """One block's bytes over every layer's tensors."""
        first = kv_caches[0][0][0]
        return first.numel() * first.element_size() * sum(len(layer) for layer in kv_caches)

    def start(self) -> None:
        """Open the directory and start the store's threads (see DiskKVStore.start)."""
        self.store.start()

    def apply(self, transfers: KVTransfers) -> None:
        """A step's copies, before its forward: saves, then loads.

        Raises:
            RuntimeError: a load of a block not staged here (the engine only hands the scheduler
                hashes every rank staged, so this is a bug, and computing on would be wrong).
        """
        for block_id, block_hash in transfers.saves:
            self.save(block_id, block_hash)
        for block_id, block_hash in transfers.loads:
            if not self.load(block_id, block_hash):
                raise RuntimeError(f"KV offload: block {block_hash.hex()} was to be loaded but is not staged")

    def save(self, block_id: int, block_hash: bytes) -> None:
        """Keep block `block_id`'s K/V under `block_hash` (copied out now if the disk lacks it)."""
        self.store.save(block_hash, lambda: self._block_bytes(block_id))

    def load(self, block_id: int, block_hash: bytes) -> bool:
        """Copy a staged block into `block_id`; False if it is not staged."""
        payload = self.store.take(block_hash)
        if payload is None:
            return False
        self._copy_in(block_id, payload)
        return True

    def stage(self, chains: Iterable[list[bytes]]) -> list[bytes]:
        """Read what the next schedule() may load (see DiskKVStore.stage); the staged hashes."""
        return self.store.stage(chains)

    def close(self, saves: Iterable[tuple[int, bytes]]) -> tuple[int, int]:
        """A graceful shutdown: save these (block_id, hash) pairs (every cached block), wait for
        the writes (bounded), stop the threads.

        Returns:
            The blocks and bytes now on disk.
        """
        for block_id, block_hash in saves:
            self.save(block_id, block_hash)
        self.store.close()
        return self.store.num_blocks, self.store.num_bytes

    @property
    def directory(self) -> Path:
        return self.store.directory

    # ---- bytes in and out of the cache tensors -----------------------------------------------

    def _block_bytes(self, block_id: int) -> bytes:
        parts = [t[block_id] for layer in self.kv_caches for t in layer]
        return torch.stack(parts).contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def _copy_in(self, block_id: int, payload: memoryview) -> None:
        first = self.kv_caches[0][0][block_id]
        data = torch.frombuffer(payload, dtype=torch.uint8).view(first.dtype)
        data = data.view(-1, *first.shape).to(first.device)
        for index, tensor in enumerate(t for layer in self.kv_caches for t in layer):
            tensor[block_id].copy_(data[index])
