"""The prefix cache's disk tier, worker side: cached blocks that leave memory go to files, and
come back. The scheduler side (core/disk_index.py) knows only hashes; this package moves bytes,
on every tensor-parallel rank, each rank its own share of the KV heads in its own directory.

    start-up (every rank)       -> open DIR/<fingerprint>/, index its files (nothing opened)
    before each schedule()      -> stage(chains): every rank reads the blocks the waiting requests
                                   may hit; the engine gives the scheduler's index the hashes all
                                   ranks staged
    schedule()                  -> a lookup's disk hit / a pool eviction: a load / a save in the
                                   step's SchedulerOutput.kv_transfers (no file, no tensor)
    the step, on every rank     -> the mover: saves copied out, loads copied in, then the forward
    graceful shutdown           -> every cached block saved, the writes waited for (bounded)
    next start, same dir        -> the file names are the index: the first requests hit

    files.py    the block file format, the checks a file must pass, rate-limited warnings
    store.py    DiskKVStore: files by hash, the reader and writer threads, the staged payloads
    mover.py    KVOffloadMover: copies between the store and this rank's KV cache tensors;
                open_mover: a rank's fingerprint, directory and store at start-up

A file holds one block of every layer's K and V (scales included for 8-bit caches), keyed by the
block's chained content hash. The fingerprint covers what makes bytes reusable: the model's
config and weight files, the dtype, the KV cache dtype and shape, the block size, the hash
function, and with tensor parallelism the rank and the number of ranks. The directory is bounded
by max_bytes: least recently used files go first.
"""

from pagedllm.worker.kv_offload.files import fingerprint
from pagedllm.worker.kv_offload.mover import KVOffloadMover, open_mover
from pagedllm.worker.kv_offload.store import DiskKVStore

__all__ = ["DiskKVStore", "KVOffloadMover", "fingerprint", "open_mover"]
