"""A GGUF file's layout: its metadata and its tensor directory, the tensors' bytes memory-mapped.

Read here rather than by the `gguf` package's GGUFReader, which makes a numpy view of every part
of every field: seconds for a tokenizer of 50-150k strings and as many merges, at each first start
of a file. The tokenizer's long arrays are walked past and left to transformers' converter.

The file is untrusted input. Every count and length is checked against the bytes left before it
is used (llama.cpp's gguf.cpp makes the same checks), so a damaged or hostile file ends in one
ModelLoadError naming the file, the field or tensor and its offset, never in a read past the end,
a loop over a count of 2^60, or a tensor whose bytes lie outside the file or over another's:

    magic "GGUF" | version (2, 3) | tensor count | kv count          24 bytes, little-endian
    kv pairs:      key string | value type | value                   (arrays: item type, count, items)
    tensor infos:  name string | ndims (1-4) | dims | type | offset  (offset: into the data region)
    padding to general.alignment (a power of two, default 32)
    data region:   each tensor's bytes at its offset, right after the one before (padded), in the file
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pagedllm.model.errors import ModelLoadError

LONGEST_ARRAY_READ = 4096
"""Metadata arrays longer than this (a vocabulary, its scores and merges) are counted, not read."""
VERSIONS = (2, 3)
"""GGUF versions read (1 had 32-bit counts; none later exists)."""
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 2**16
"""general.alignment: a power of two up to this (writers use 32; llama.cpp's own default)."""
MAX_DIMS = 4
"""GGML_MAX_DIMS: a tensor has 1 to 4 dimensions."""
MAX_TENSOR_NAME_BYTES = 63
"""GGML_MAX_NAME less its terminating zero: llama.cpp refuses longer names."""
MAX_ELEMENTS = 2**63 - 1
"""A tensor's element count must fit in int64, as ggml counts it."""

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF metadata value types -> struct formats (8 is a string, 9 an array)."""
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 4 + 1
"""The smallest key-value pair: an empty key's length, the value type, a one-byte value."""
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
"""The smallest tensor info: an empty name's length, ndims, one dimension, type, offset."""
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12} | {k: struct.calcsize(f) for k, f in _SCALAR_FORMATS.items()}
"""Each value type's smallest encoding: a count of items times this must fit in the bytes left."""


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its raw bytes (a view of the mapped file) and how to read them."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    """GGUF's order: the row length first."""
    data: np.ndarray
    release: Callable[[], None] = lambda: None
    """Let the memory holding these bytes go (they are read from the file again if used)."""


@dataclass
class GGUFContents:
    metadata: dict[str, Any] = field(default_factory=dict)
    """Each key's value: a number, a string, or a list of them (arrays up to LONGEST_ARRAY_READ;
    an array of arrays, which no field pagedllm reads is, only counted)."""
    array_lengths: dict[str, int] = field(default_factory=dict)
    """Every array's length, the long ones left out of `metadata` included."""
    tensors: list[GGUFTensor] = field(default_factory=list)
    file_size: int = 0
    key_offsets: dict[str, int] = field(default_factory=dict)
    """Where each key's pair starts in the file, for errors that name a field."""


@dataclass
class _TensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    start: int
    """Into the data region."""
    num_bytes: int
    info_offset: int
    """Where its info starts in the file (for errors)."""


class _Cursor:
    """Reads the header in order, every read checked against the end of the file."""

    def __init__(self, path: Path, buffer: memoryview) -> None:
        self.path, self.buffer, self.offset, self.size = path, buffer, 0, len(buffer)

    def error(self, what: str, problem: str, offset: int | None = None) -> ModelLoadError:
        at = self.offset if offset is None else offset
        return ModelLoadError(f"{self.path}: {what} at offset {at:,}: {problem}")

    @property
    def left(self) -> int:
        return self.size - self.offset

    def take(self, fmt: str, what: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if size > self.left:
            raise self.error(what, f"the file ends {self.left} bytes on, {size} needed (truncated?)")
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return values

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, which must fit in the bytes left."""
        at = self.offset
        (count,) = self.take("<Q", what)
        if count * item_bytes > self.left:
            raise self.error(
                what, f"{count:,} items of {item_bytes}+ bytes cannot fit in the {self.left:,} left", at
            )
        return count

    def string(self, what: str, max_bytes: int | None = None) -> str:
        at = self.offset
        length = self.count(f"{what} (its length)", 1)
        if max_bytes is not None and length > max_bytes:
            raise self.error(what, f"{length:,} bytes long; at most {max_bytes} are allowed", at)
        text = bytes(self.buffer[self.offset : self.offset + length]).decode("utf-8", "replace")
        self.offset += length
        return text

    def value(self, kind: int, what: str) -> Any:
        if kind == _STRING:
            return self.string(what)
        if kind not in _SCALAR_FORMATS:
            raise self.error(what, f"unknown value type {kind} (known: 0-12)")
        return self.take("<" + _SCALAR_FORMATS[kind], what)[0]

    def array(self, what: str, nested: bool = False) -> tuple[int, list[Any] | None]:
        """An array's length, and its items where it is short and flat (else None). An array of
        arrays is walked one level deep; arrays nested deeper are refused (no recursion)."""
        at = self.offset
        (item_kind,) = self.take("<I", f"{what} (its item type)")
        if item_kind not in _MIN_ITEM_BYTES:
            raise self.error(what, f"unknown item type {item_kind} (known: 0-12)", at)
        if item_kind == _ARRAY and nested:
            raise self.error(what, "arrays nested more than two deep (no GGUF field is)", at)
        count = self.count(f"{what} (its length)", _MIN_ITEM_BYTES[item_kind])
        if item_kind in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[item_kind]}"
            if count > LONGEST_ARRAY_READ:
                self.offset += struct.calcsize(fmt)  # count() checked it fits
                return count, None
            return count, list(self.take(fmt, what))
        if item_kind == _ARRAY:
            for index in range(count):
                self.array(f"{what}[{index}]", nested=True)
            return count, None
        if count > LONGEST_ARRAY_READ:
            self.skip_strings(count, what)
            return count, None
        return count, [self.string(f"{what}[{index}]") for index in range(count)]

    def skip_strings(self, count: int, what: str) -> None:
        """Past `count` strings (a vocabulary: 50-250k of them), each length checked, in a loop
        kept to the arithmetic: the reader's share of a start-up."""
        buffer, offset, size = self.buffer, self.offset, self.size
        for index in range(count):
            if offset + 8 > size:
                raise self.error(f"{what}[{index}]", "the file ends inside it (truncated?)", offset)
            (length,) = _U64.unpack_from(buffer, offset)
            if length > size - offset - 8:
                raise self.error(
                    f"{what}[{index}]", f"{length:,} bytes long, past the end of the file", offset
                )
            offset += 8 + length
        self.offset = offset


def read_gguf(gguf_path: Path) -> GGUFContents:
    """The file's metadata and tensors, their bytes memory-mapped (nothing of them is read);
    ModelLoadError for a file that is not a well-formed GGUF."""
    size = gguf_path.stat().st_size
    if size < 24:
        raise ModelLoadError(f"{gguf_path}: {size} bytes, too short for a GGUF header (24 bytes)")
    with open(gguf_path, "rb") as file:  # copy-on-write: writable views, no copy
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    cursor = _Cursor(gguf_path, memoryview(mapping))
    magic, version = cursor.take("<4sI", "header")
    if magic != b"GGUF":
        raise cursor.error("header", f"magic {magic!r} is not b'GGUF': not a GGUF file", 0)
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version >= 2**16 else ""
        raise cursor.error("header", f"version {version}{hint} is not one pagedllm reads (2 or 3)", 4)
    (num_tensors,) = cursor.take("<Q", "tensor count")
    (num_fields,) = cursor.take("<Q", "metadata count")
    needed = num_tensors * _MIN_TENSOR_INFO_BYTES + num_fields * _MIN_KV_BYTES
    if needed > cursor.left:
        raise cursor.error(
            "header",
            f"{num_tensors:,} tensors and {num_fields:,} metadata keys cannot fit in {size:,} bytes",
            8,
        )
    contents = GGUFContents(file_size=size)
    _read_metadata(cursor, num_fields, contents)
    alignment = _alignment(cursor, contents)
    infos = [_read_tensor_info(cursor, index, alignment) for index in range(num_tensors)]
    _check_names_unique(cursor, infos)
    data_start = -(-cursor.offset // alignment) * alignment
    _check_data_regions(cursor, infos, data_start, alignment)
    mapped = np.frombuffer(mapping, dtype=np.uint8)
    for info in infos:
        begin = data_start + info.start
        release = functools.partial(_drop_pages, mapping, begin, info.num_bytes)
        data = mapped[begin : begin + info.num_bytes]
        contents.tensors.append(GGUFTensor(info.name, info.tensor_type, info.shape, data, release))
    return contents


def read_tensor_directory(gguf_path: Path) -> list[GGUFTensor]:
    """The file's tensors, their bytes memory-mapped."""
    return read_gguf(gguf_path).tensors


def _read_metadata(cursor: _Cursor, num_fields: int, contents: GGUFContents) -> None:
    for index in range(num_fields):
        at = cursor.offset
        key = cursor.string(f"metadata key {index}")
        if key in contents.metadata or key in contents.array_lengths:
            raise cursor.error(f"metadata key {key!r}", "appears twice", at)
        contents.key_offsets[key] = at
        (kind,) = cursor.take("<I", f"metadata {key!r} (its type)")
        if kind == _ARRAY:
            count, items = cursor.array(f"metadata {key!r}")
            contents.array_lengths[key] = count
            if items is not None:
                contents.metadata[key] = items
        else:
            contents.metadata[key] = cursor.value(kind, f"metadata {key!r}")


def _alignment(cursor: _Cursor, contents: GGUFContents) -> int:
    alignment = contents.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise cursor.error(
            "metadata 'general.alignment'",
            f"{alignment!r} is not a power of two up to {MAX_ALIGNMENT:,} (writers use 32)",
            contents.key_offsets.get("general.alignment", 24),
        )
    return alignment


def _read_tensor_info(cursor: _Cursor, index: int, alignment: int) -> _TensorInfo:
    at = cursor.offset
    name = cursor.string(f"tensor {index}'s name", MAX_TENSOR_NAME_BYTES)
    what = f"tensor {name!r}"
    (num_dims,) = cursor.take("<I", f"{what} (its ndims)")
    if not 1 <= num_dims <= MAX_DIMS:
        raise cursor.error(what, f"{num_dims} dimensions; a tensor has 1 to {MAX_DIMS}", at)
    shape = cursor.take(f"<{num_dims}Q", f"{what} (its dimensions)")
    if not all(dim >= 1 for dim in shape) or math.prod(shape) > MAX_ELEMENTS:
        raise cursor.error(what, f"shape {list(shape)}: every dimension must be 1 or more, 2^63 in all", at)
    kind, start = cursor.take("<IQ", f"{what} (its type and offset)")
    tensor_type = _tensor_type(kind)
    if tensor_type is None:
        raise cursor.error(what, f"unknown tensor type {kind}", at)
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    if shape[0] % block_size:
        raise cursor.error(
            what, f"rows of {shape[0]} values cannot be {tensor_type.name} blocks of {block_size}", at
        )
    if start % alignment:
        raise cursor.error(what, f"data offset {start:,} is not a multiple of the alignment {alignment}", at)
    num_bytes = math.prod(shape) // block_size * type_size
    return _TensorInfo(name, tensor_type, tuple(shape), start, num_bytes, at)


def _tensor_type(kind: int) -> gguf.GGMLQuantizationType | None:
    """The GGML type numbered `kind`, where the `gguf` package knows its block layout."""
    try:
        tensor_type = gguf.GGMLQuantizationType(kind)
    except ValueError:
        return None
    return tensor_type if tensor_type in gguf.GGML_QUANT_SIZES else None


def _check_names_unique(cursor: _Cursor, infos: list[_TensorInfo]) -> None:
    seen: set[str] = set()
    for info in infos:
        if info.name in seen:
            raise cursor.error(f"tensor {info.name!r}", "a second tensor of that name", info.info_offset)
        seen.add(info.name)


def _check_data_regions(cursor: _Cursor, infos: list[_TensorInfo], data_start: int, alignment: int) -> None:
    """Each tensor's bytes inside the file, right after the one before it (padded to the alignment),
    as llama.cpp requires: so no two tensors share a byte, and a tensor whose type or shape was
    changed (its size with it) shows as an offset where none was expected."""
    expected, previous = 0, "the data region's start"
    for info in infos:
        begin, end = data_start + info.start, data_start + info.start + info.num_bytes
        what = f"tensor {info.name!r} ({info.tensor_type.name} {list(info.shape)})"
        if info.start != expected:
            between = "the two overlap" if info.start < expected else "a gap lies between them"
            raise cursor.error(
                what,
                f"data offset {info.start:,}, but {previous} ends at {expected:,}: {between} "
                "(one of them retyped, resized or moved?)",
                info.info_offset,
            )
        if end > cursor.size:
            raise cursor.error(
                what,
                f"its {info.num_bytes:,} bytes at {begin:,} run past the end of the file "
                f"({cursor.size:,} bytes; truncated?)",
                info.info_offset,
            )
        expected = info.start + -(-info.num_bytes // alignment) * alignment
        previous = f"{info.name!r} ({info.tensor_type.name} {list(info.shape)}) before it"


def _drop_pages(mapping: mmap.mmap, begin: int, size: int) -> None:
    """Drop the mapped pages wholly inside bytes begin .. begin + size from this process's memory
    (MADV_DONTNEED: clean private pages are read from the file again if touched), so that a
    model's resident size does not hold the file beside its packed copy while it loads."""
    start = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (begin + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
