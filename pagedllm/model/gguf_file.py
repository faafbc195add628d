"""A GGUF file's layout: its metadata and its tensor directory, the tensors' bytes memory-mapped.

Read here rather than by the `gguf` package's GGUFReader, which makes a numpy view of every part
of every field: seconds for a tokenizer of 50-150k strings and as many merges, at each first start
of a file. The tokenizer's long arrays are walked past and left to transformers' converter.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

LONGEST_ARRAY_READ = 4096
"""Metadata arrays longer than this (a vocabulary, its scores and merges) are counted, not read."""

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF metadata value types -> struct formats (8 is a string, 9 an array)."""
_STRING, _ARRAY = 8, 9


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


def read_gguf(gguf_path: Path) -> GGUFContents:
    """The file's metadata and tensors, their bytes memory-mapped (nothing of them is read)."""
    with open(gguf_path, "rb") as file:  # copy-on-write: writable views, no copy
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    buffer = memoryview(mapping)
    magic, version, num_tensors, num_fields = struct.unpack_from("<4sIQQ", buffer, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{gguf_path}: not a GGUF file of version 2 or later")
    contents = GGUFContents()
    offset = 24
    for _ in range(num_fields):
        key, offset = _string(buffer, offset)
        (kind,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        if kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", buffer, offset)
            contents.array_lengths[key] = count
            if count <= LONGEST_ARRAY_READ and item_kind != _ARRAY:  # arrays of arrays: none read
                contents.metadata[key] = _array(buffer, offset + 12, item_kind, count)
        else:
            contents.metadata[key] = _value(buffer, offset, kind)
        offset = _skip_value(buffer, offset, kind)
    infos = []
    for _ in range(num_tensors):
        name, offset = _string(buffer, offset)
        (num_dims,) = struct.unpack_from("<I", buffer, offset)
        shape = struct.unpack_from(f"<{num_dims}Q", buffer, offset + 4)
        kind, start = struct.unpack_from("<IQ", buffer, offset + 4 + 8 * num_dims)
        offset += 4 + 8 * num_dims + 12
        infos.append((name, gguf.GGMLQuantizationType(kind), shape, start))
    alignment = int(contents.metadata.get("general.alignment", 32))
    data_start = (offset + alignment - 1) // alignment * alignment
    mapped = np.frombuffer(mapping, dtype=np.uint8)
    for name, kind, shape, start in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        begin = data_start + start
        size = int(np.prod(shape)) // block_size * type_size
        release = functools.partial(_drop_pages, mapping, begin, size)
        contents.tensors.append(GGUFTensor(name, kind, shape, mapped[begin : begin + size], release))
    return contents


def read_tensor_directory(gguf_path: Path) -> list[GGUFTensor]:
    """The file's tensors, their bytes memory-mapped."""
    return read_gguf(gguf_path).tensors


def _drop_pages(mapping: mmap.mmap, begin: int, size: int) -> None:
    """Drop the mapped pages wholly inside bytes begin .. begin + size from this process's memory
    (MADV_DONTNEED: clean private pages are read from the file again if touched), so that a
    model's resident size does not hold the file beside its packed copy while it loads."""
    start = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (begin + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _string(buffer: memoryview, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, offset)
    return bytes(buffer[offset + 8 : offset + 8 + length]).decode("utf-8", "replace"), offset + 8 + length


def _value(buffer: memoryview, offset: int, kind: int) -> Any:
    if kind == _STRING:
        return _string(buffer, offset)[0]
    if kind not in _SCALAR_FORMATS:
        raise ValueError(f"GGUF metadata value of unknown type {kind}")
    return struct.unpack_from("<" + _SCALAR_FORMATS[kind], buffer, offset)[0]


def _array(buffer: memoryview, offset: int, item_kind: int, count: int) -> list[Any]:
    if item_kind in _SCALAR_FORMATS:
        return list(struct.unpack_from(f"<{count}{_SCALAR_FORMATS[item_kind]}", buffer, offset))
    items = []
    for _ in range(count):
        items.append(_value(buffer, offset, item_kind))
        offset = _skip_value(buffer, offset, item_kind)
    return items


def _skip_value(buffer: memoryview, offset: int, kind: int) -> int:
    if kind in _SCALAR_FORMATS:
        return offset + struct.calcsize("<" + _SCALAR_FORMATS[kind])
    if kind == _STRING:
        (length,) = struct.unpack_from("<Q", buffer, offset)
        return offset + 8 + length
    if kind != _ARRAY:
        raise ValueError(f"GGUF metadata value of unknown type {kind}")
    item_kind, count = struct.unpack_from("<IQ", buffer, offset)
    offset += 12
    if item_kind in _SCALAR_FORMATS:
        return offset + count * struct.calcsize("<" + _SCALAR_FORMATS[item_kind])
    for _ in range(count):
        offset = _skip_value(buffer, offset, item_kind)
    return offset
