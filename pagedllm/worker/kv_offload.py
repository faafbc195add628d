"""The prefix cache's disk tier: cached blocks that leave memory go to files, and come back.

    evicted from the pool   -> save(block, hash): K/V copied out now, written by a writer thread
    a later prefix lookup   -> load(block, hash): read, checked, copied into a fresh block
    graceful shutdown       -> save every cached block, then wait for the writes
    next start, same dir    -> the files are the index: the first requests hit

A file holds one block of every layer's K and V (scales included for 8-bit caches), keyed by the
block's chained content hash, under DIR/<fingerprint>/. The fingerprint covers what makes bytes
reusable: the model's config and weight files, the dtype, the KV cache dtype and shape, the block
size and the hash function. Each file carries the fingerprint and a CRC32 of its payload; a file
that does not match is skipped with a warning and deleted, never loaded into a wrong cache. The
directory is bounded by max_bytes: least recently used files go first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"PGKV1\n"


def fingerprint(model_folder: Path, parts: Iterable[object]) -> str:
    """What must match for stored K/V to be reused: the model (config, weight file names and
    sizes) and the cache's layout (`parts`: dtypes, shapes, block size, hash function)."""
    digest = hashlib.sha256()
    config = model_folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else str(model_folder).encode())
    for weights in sorted(model_folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()[:32]


class DiskKVStore:
    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        fingerprint_hex: str,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> None:
        self.fingerprint = fingerprint_hex
        self.directory = Path(directory) / fingerprint_hex
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.kv_caches = kv_caches
        self._files: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file size, LRU first
        self._num_bytes = 0
        self._lock = threading.Lock()
        # (hash, payload) to write, an Event to set once everything before it is written, None: stop
        self._writes: queue.SimpleQueue[tuple[bytes, bytes] | threading.Event | None] = queue.SimpleQueue()
        self._pending: set[bytes] = set()  # queued, not yet on disk
        self.num_refused = 0
        self._index()
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-offload", daemon=True)
        self._writer.start()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def __contains__(self, block_hash: bytes) -> bool:
        """On disk (a block still queued for writing is not, yet)."""
        with self._lock:
            return block_hash in self._files

    def save(self, block_id: int, block_hash: bytes) -> None:
        """Copy one block's K/V out now (the caller is about to reuse the block); write later."""
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return
            if block_hash in self._pending:
                return
            self._pending.add(block_hash)
        self._writes.put((block_hash, self._block_bytes(block_id)))

    def load(self, block_id: int, block_hash: bytes) -> bool:
        """Read one block into `block_id`; False (and the file gone) if it is missing or does not
        match this cache."""
        payload = self._read(block_hash)
        if payload is None:
            return False
        self._copy_in(block_id, payload)
        return True

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        done = threading.Event()
        self._writes.put(done)
        done.wait()

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join()

    # ---- bytes in and out of the cache tensors -----------------------------------------------

    def _block_bytes(self, block_id: int) -> bytes:
        parts = [t[block_id] for layer in self.kv_caches for t in layer]
        return torch.stack(parts).contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def _copy_in(self, block_id: int, payload: bytes) -> None:
        first = self.kv_caches[0][0][block_id]
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(first.dtype)
        data = data.view(-1, *first.shape).to(first.device)
        for index, tensor in enumerate(t for layer in self.kv_caches for t in layer):
            tensor[block_id].copy_(data[index])

    @property
    def _block_nbytes(self) -> int:
        first = self.kv_caches[0][0][0]
        return first.numel() * first.element_size() * sum(len(layer) for layer in self.kv_caches)

    # ---- files -----------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}.kv"

    def _index(self) -> None:
        """The files already there, oldest first, as the LRU order."""
        entries = []
        for path in self.directory.glob("*.kv"):
            try:
                entries.append((path.stat().st_mtime, bytes.fromhex(path.stem), path.stat().st_size))
            except (OSError, ValueError):
                continue
        for _, block_hash, size in sorted(entries):
            self._files[block_hash] = size
            self._num_bytes += size
        if self._files:
            logger.info(
                "KV offload: %d cached blocks (%.2f GiB) in %s",
                len(self._files),
                self.num_bytes / 2**30,
                self.directory,
            )

    def _read(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            if block_hash not in self._files:
                return None
            self._files.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(block_hash)
            return None
        payload = self._check(raw, block_hash)
        if payload is None:
            self.num_refused += 1
            logger.warning(
                "KV offload: %s does not match this cache (fingerprint, size or checksum); deleted", path
            )
            self._forget(block_hash, delete=True)
            return None
        os.utime(path)  # its place in the LRU order survives a restart
        return payload

    def _check(self, raw: bytes, block_hash: bytes) -> bytes | None:
        header = MAGIC + bytes.fromhex(self.fingerprint) + block_hash
        body = raw[len(header) + 4 :]
        if not raw.startswith(header) or len(body) != self._block_nbytes:
            return None
        if zlib.crc32(body) != int.from_bytes(raw[len(header) : len(header) + 4], "little"):
            return None
        return body

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            block_hash, payload = item
            try:
                self._write(block_hash, payload)
            except OSError as error:
                logger.warning("KV offload: writing a block failed (%s); it is not kept", error)
            finally:
                with self._lock:
                    self._pending.discard(block_hash)

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        header = MAGIC + bytes.fromhex(self.fingerprint) + block_hash
        data = header + zlib.crc32(payload).to_bytes(4, "little") + payload
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._files[block_hash] = len(data)
            self._num_bytes += len(data)
            victims = []
            while self._num_bytes > self.max_bytes and self._files:
                victim, size = self._files.popitem(last=False)
                victims.append(victim)
                self._num_bytes -= size
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _forget(self, block_hash: bytes, delete: bool = False) -> None:
        with self._lock:
            self._num_bytes -= self._files.pop(block_hash, 0)
        if delete:
            self._path(block_hash).unlink(missing_ok=True)
