"""The disk tier's block files: their format, the checks a file must pass before its bytes are
trusted, and the rate-limited warnings every failure goes through.

    DIR/<fingerprint>/<block hash hex>.kv:
    +-----------+------------------+------------+--------+----------------------------------+
    | MAGIC (6) | fingerprint (16) | block hash | CRC32  | payload: every layer's K and V   |
    |           |                  |            | (4, LE)| (and scales) of one block        |
    +-----------+------------------+------------+--------+----------------------------------+

A file is read only if lstat and fstat say it is a regular file of exactly a block file's size,
opened O_NONBLOCK|O_NOFOLLOW (a FIFO or a link under a block's name cannot block or redirect the
read); its header must name this cache and its payload match the CRC.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"PGKV1\n"
WARN_INTERVAL_S = 60.0


def fingerprint(model_folder: Path, parts: Iterable[object]) -> str:
    """What must match for stored K/V to be reused: the model (config, weight file names and
    sizes) and the cache's layout (`parts`: dtypes, shapes, block size, hash function, and with
    tensor parallelism the rank and the number of ranks: each rank stores its share of the heads)."""
    digest = hashlib.sha256()
    config = model_folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else str(model_folder).encode())
    for weights in sorted(model_folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    for part in parts:
        digest.update(repr(part).encode())
    return digest.hexdigest()[:32]


class BlockFileFormat:
    """The header, size and checks of one cache's block files (one fingerprint, one block size)."""

    def __init__(self, fingerprint_hex: str, payload_nbytes: int) -> None:
        self.fingerprint = fingerprint_hex
        self.payload_nbytes = payload_nbytes

    def header(self, block_hash: bytes) -> bytes:
        return MAGIC + bytes.fromhex(self.fingerprint) + block_hash

    def file_nbytes(self, block_hash: bytes) -> int:
        return len(self.header(block_hash)) + 4 + self.payload_nbytes

    def encode_prefix(self, block_hash: bytes, payload: bytes) -> bytes:
        """What goes before the payload: the header and the payload's CRC32."""
        return self.header(block_hash) + zlib.crc32(payload).to_bytes(4, "little")

    def decode(self, raw: bytearray, block_hash: bytes) -> memoryview | None:
        """The payload of a whole file's bytes, or None if it is not this block of this cache."""
        header = self.header(block_hash)
        body = memoryview(raw)[len(header) + 4 :]
        if raw[: len(header)] != header:  # its length is a block file's: read so
            return None
        if zlib.crc32(body) != int.from_bytes(raw[len(header) : len(header) + 4], "little"):
            return None
        return body


def mismatch(info: os.stat_result, size: int) -> str | None:
    """Why a file cannot be a block file of `size` bytes, or None."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_size != size:
        return f"{info.st_size:,} bytes, not {size:,}"
    return None


def read_exactly(fd: int, size: int) -> bytearray | None:
    """`size` bytes, or None if the file ends sooner (it shrank since fstat)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        count = os.readv(fd, [view[done:]])
        if count == 0:
            return None
        done += count
    return buffer


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RateLimitedWarnings:
    """One line per message template a minute, with how many were held back: a failing disk
    must not flood the log."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, template: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(template)
            if last is not None and now - last < WARN_INTERVAL_S:
                self._held[template] = self._held.get(template, 0) + 1
                return
            self._last[template] = now
            held = self._held.pop(template, 0)
        self._log.warning(template + (f" ({held} more like it held back)" if held else ""), *args)
