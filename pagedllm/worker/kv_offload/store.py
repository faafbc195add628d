"""DiskKVStore: one rank's block files by chained hash, and the two threads that do all its
file I/O. It deals in bytes (a block's K/V payload), never in cache tensors: the mover copies.

    save(hash, payload)   queued; the writer thread writes it (.tmp, then renamed), evicting the
                          least recently used files past max_bytes
    stage(chains)         the reader thread reads and checks the leading run of each chain that
                          is on disk; a bounded wait; returns what is staged (readable now)
    take(hash)            a staged payload, without touching a file
    start / close         index the directory (sweeping stale .tmp files) / flush, bounded

The tier can cost hits, never the engine: any OSError is a miss, warned about at most once a
minute per kind; a file that is not this block of this cache is refused (never loaded) and
deleted; a directory that cannot be written is served read-only.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path

from pagedllm.worker.kv_offload.files import (
    BlockFileFormat,
    RateLimitedWarnings,
    mismatch,
    read_exactly,
    write_all,
)

logger = logging.getLogger(__name__)

READ_WAIT_S = 2.0
"""Longest a step waits for staged reads; a read running longer marks the disk stuck, and steps
stop waiting for it (what is not staged in time is computed instead)."""
CLOSE_WAIT_S = 120.0
"""Longest a graceful shutdown waits for queued writes (a hung disk must not hang SIGTERM)."""
_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class DiskKVStore:
    """Blocks on disk by chained hash. The caller's thread (the worker's) calls save, stage, `in`
    and take, which never touch a file; the writer and reader threads (start() starts them) do
    all file I/O."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        fingerprint_hex: str,
        payload_nbytes: int,
        max_staged_blocks: int,
    ) -> None:
        """`payload_nbytes`: one block's K/V (every layer's, scales included) as stored."""
        self.fingerprint = fingerprint_hex
        self.root = Path(directory)
        self.directory = self.root / fingerprint_hex
        self.max_bytes = max_bytes
        self.format = BlockFileFormat(fingerprint_hex, payload_nbytes)
        self.max_staged_blocks = max_staged_blocks
        """Most blocks held in memory between their read and their load (one stage()'s worth)."""
        self.read_only = False
        self.num_refused = 0
        self._cond = threading.Condition()  # guards every field below
        self._files: OrderedDict[bytes, int] = OrderedDict()  # on disk: hash -> file size, LRU first
        self._num_bytes = 0
        self._pending: set[bytes] = set()  # saved, not yet on disk
        self._wanted: set[bytes] = set()  # what the last stage() asked for
        self._to_read: deque[bytes] = deque()
        self._reading: set[bytes] = set()  # queued or being read
        self._read_started: float | None = None  # when the reader began its current file
        self._staged: dict[bytes, memoryview] = {}  # read and checked: a block's K/V payload
        self._closed = False
        # (hash, payload) to write, an Event to set once everything before it is written, None: stop
        self._writes: queue.SimpleQueue[tuple[bytes, bytes] | threading.Event | None] = queue.SimpleQueue()
        self._tmp_names = itertools.count()
        self._warnings = RateLimitedWarnings(logger)

    def start(self) -> None:
        """Open the directory (created if missing, served read-only if it cannot be written),
        index its files and start the writer and reader threads.

        Raises:
            ValueError: naming --kv-offload-dir, when the directory cannot be created.
        """
        self._open_directory()
        self._index()
        for target, name in ((self._write_loop, "writer"), (self._read_loop, "reader")):
            threading.Thread(target=target, name=f"pagedllm-kv-offload-{name}", daemon=True).start()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    # ---- the caller's thread: no file I/O ----------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        """Staged: takeable now, without touching a file."""
        with self._cond:
            return block_hash in self._staged

    def take(self, block_hash: bytes) -> memoryview | None:
        """A staged block's payload (it is staged no more), or None if it is not staged."""
        with self._cond:
            return self._staged.pop(block_hash, None)

    def save(self, block_hash: bytes, read_payload: Callable[[], bytes]) -> None:
        """Keep a block: `read_payload()` (its K/V, copied out now: the caller is about to reuse
        the block) is called only if the block is not on disk or queued already; written later."""
        if self.read_only:
            return
        with self._cond:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return
            if block_hash in self._pending:
                return
            self._pending.add(block_hash)
        self._writes.put((block_hash, read_payload()))

    def stage(self, chains: Iterable[list[bytes]]) -> list[bytes]:
        """Have the blocks the next schedule() may load read and checked before it runs.

        Args:
            chains: per waiting request, its block hashes after those cached in memory; of
                each, the leading run on disk is staged, up to max_staged_blocks in all.

        Returns:
            The staged hashes: what take() returns until the next stage().

        Staged blocks no chain wants any more are dropped. Waits at most READ_WAIT_S, and not
        at all while the reader is stuck on one file that long: what is not staged is a miss.
        """
        with self._cond:
            wanted = self._wanted_blocks(chains)
            self._wanted = set(wanted)
            for block_hash in [h for h in self._staged if h not in self._wanted]:
                del self._staged[block_hash]
            for block_hash in wanted:
                if block_hash not in self._staged and block_hash not in self._reading:
                    self._reading.add(block_hash)
                    self._to_read.append(block_hash)
            self._cond.notify_all()
            deadline = time.monotonic() + READ_WAIT_S
            while any(h in self._reading for h in wanted) and not self._is_reader_stuck():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return list(self._staged)

    def _wanted_blocks(self, chains: Iterable[list[bytes]]) -> list[bytes]:
        wanted: dict[bytes, None] = {}
        for chain in chains:
            for block_hash in chain:
                if len(wanted) == self.max_staged_blocks:
                    return list(wanted)
                if block_hash not in self._staged and block_hash not in self._files:
                    break
                wanted[block_hash] = None
        return list(wanted)

    def _is_reader_stuck(self) -> bool:
        started = self._read_started
        return started is not None and time.monotonic() - started > READ_WAIT_S

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is on disk (or failed); False if `timeout` ran out."""
        done = threading.Event()
        self._writes.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Wait for the queued writes, at most CLOSE_WAIT_S, then stop both threads."""
        if not self.flush(CLOSE_WAIT_S):
            logger.warning(
                "KV offload: writes to %s still queued after %.0f s; left", self.directory, CLOSE_WAIT_S
            )
        self._writes.put(None)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- files: start-up ---------------------------------------------------------------------

    def _open_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if not self.root.is_dir():
                raise ValueError(
                    f"kv_offload_dir: cannot create {self.root} ({error.strerror or error}); "
                    "create it or point --kv-offload-dir at a writable directory"
                ) from None
            self._become_read_only(error)
            return
        probe = self.directory / f".probe.{os.getpid()}.tmp"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.unlink(probe)
        except OSError as error:
            self._become_read_only(error)

    def _become_read_only(self, error: OSError) -> None:
        self.read_only = True
        logger.warning(
            "KV offload: --kv-offload-dir %s is not writable (%s): served read-only; evicted blocks "
            "are not kept and nothing is written at shutdown",
            self.root,
            error.strerror or error,
        )

    def _index(self) -> None:
        """The block files already there, oldest first, as the LRU order; stale .tmp files (a
        write cut short by a crash or a full disk) removed. Only lstat: nothing is opened."""
        entries = []
        try:
            with os.scandir(self.directory) as scan:
                for entry in scan:
                    if entry.name.endswith(".tmp") and not self.read_only:
                        self._unlink(Path(entry.path))
                        continue
                    with contextlib.suppress(OSError, ValueError):
                        info = entry.stat(follow_symlinks=False)
                        if entry.name.endswith(".kv") and stat.S_ISREG(info.st_mode):
                            entries.append((info.st_mtime, bytes.fromhex(entry.name[:-3])))
        except OSError as error:
            self._warnings.warn("KV offload: cannot list %s (%s); no blocks from it", self.directory, error)
        for _, block_hash in sorted(entries):
            self._add_file(block_hash)
        if self._files:
            logger.info(
                "KV offload: %d cached blocks (%.2f GiB) in %s%s",
                len(self._files),
                self.num_bytes / 2**30,
                self.directory,
                " (read-only)" if self.read_only else "",
            )

    # ---- files: the reader thread --------------------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            with self._cond:
                while not self._to_read and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                block_hash = self._to_read.popleft()
                if block_hash not in self._wanted:
                    self._reading.discard(block_hash)
                    continue
                self._read_started = time.monotonic()
            payload = None
            try:
                payload = self._read(block_hash)
            finally:
                with self._cond:
                    self._read_started = None
                    self._reading.discard(block_hash)
                    if payload is not None and block_hash in self._wanted:
                        self._staged[block_hash] = payload
                    self._cond.notify_all()

    def _read(self, block_hash: bytes) -> memoryview | None:
        """A block's checked payload, or None (a miss; a file that is not this block refused)."""
        path = self._path(block_hash)
        size = self._file_nbytes(block_hash)
        try:
            if reason := mismatch(os.lstat(path), size):
                self._refuse(block_hash, reason)
                return None
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                # the file opened, not the one lstat saw: it may have been swapped since
                if reason := mismatch(os.fstat(fd), size):
                    self._refuse(block_hash, reason)
                    return None
                raw = read_exactly(fd, size)
                if raw is not None and not self.read_only:
                    self._touch(fd, path)
            finally:
                os.close(fd)
        except OSError as error:
            self._warnings.warn(
                "KV offload: reading %s failed (%s); a cache miss", path, error.strerror or error
            )
            self._forget(block_hash)
            return None
        payload = self.format.decode(raw, block_hash) if raw is not None else None
        if payload is None:
            self._refuse(block_hash, "fingerprint, size or checksum")
            return None
        with self._cond:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        return payload

    def _touch(self, fd: int, path: Path) -> None:
        """Its place in the LRU order survives a restart (a failure costs only that)."""
        try:
            os.utime(fd)
        except OSError as error:
            self._warnings.warn("KV offload: cannot touch %s (%s)", path, error.strerror or error)

    def _refuse(self, block_hash: bytes, reason: str) -> None:
        """A file under a block's name that is not that block of this cache: never loaded."""
        with self._cond:
            self.num_refused += 1
        self._warnings.warn(
            "KV offload: %s does not match this cache (%s); %s",
            self._path(block_hash),
            reason,
            "ignored" if self.read_only else "deleted",
        )
        self._forget(block_hash, delete=not self.read_only)

    # ---- files: the writer thread --------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            block_hash, payload = item
            try:
                if not self.read_only:
                    self._write(block_hash, payload)
            except OSError as error:
                if error.errno in _READ_ONLY_ERRNOS:
                    self._become_read_only(error)
                else:
                    self._warnings.warn(
                        "KV offload: writing a block to %s failed (%s); it is not kept",
                        self.directory,
                        error.strerror or error,
                    )
            finally:
                with self._cond:
                    self._pending.discard(block_hash)

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{next(self._tmp_names)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                write_all(fd, self.format.encode_prefix(block_hash, payload))
                write_all(fd, payload)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        victims = []
        with self._cond:
            self._add_file(block_hash)
            while self._num_bytes > self.max_bytes and self._files:
                victim, size = self._files.popitem(last=False)
                victims.append(victim)
                self._num_bytes -= size
        for victim in victims:
            self._unlink(self._path(victim))

    # ---- files: either thread ------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}.kv"

    def _file_nbytes(self, block_hash: bytes) -> int:
        return self.format.file_nbytes(block_hash)

    def _add_file(self, block_hash: bytes) -> None:
        """Counted at a block file's size whatever is there: a huge file under a block's name is
        refused when read and cannot push good blocks out meanwhile."""
        if block_hash not in self._files:
            self._files[block_hash] = self._file_nbytes(block_hash)
            self._num_bytes += self._files[block_hash]

    def _forget(self, block_hash: bytes, delete: bool = False) -> None:
        with self._cond:
            self._num_bytes -= self._files.pop(block_hash, 0)
        if delete:
            self._unlink(self._path(block_hash))

    def _unlink(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self._warnings.warn("KV offload: cannot delete %s (%s)", path, error.strerror or error)
