# ruff: noqa: E501  (the case tables: one case a line reads better than one wrapped over five)
"""A corpus of damaged and hostile model files: GGUFs and Hugging Face folders, each one small valid
model with one thing wrong (truncated, a count of 2^62, a tensor over another, a config of 2e8
layers...). tests/model/test_hostile_files.py loads each and expects one ModelLoadError line.

GGUFs are laid out here byte by byte (build_gguf) rather than by the `gguf` package's writer,
which refuses to write most of these; the base model is a 2-layer Llama of hidden size 64.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {
    U8: "B",
    I8: "b",
    U16: "H",
    I16: "h",
    U32: "I",
    I32: "i",
    F32: "f",
    BOOL: "?",
    U64: "Q",
    I64: "q",
    F64: "d",
}
# GGML tensor types
T_F32, T_F16, T_Q4_0 = 0, 1, 2
_TYPE_SIZES = {T_F32: (1, 4), T_F16: (1, 2), T_Q4_0: (32, 18)}

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 64, 4, 2, 16, 128, 256, 2


@dataclass
class Kv:
    key: str
    kind: int
    value: Any
    item_kind: int | None = None
    raw: bytes | None = None
    """The value's bytes as they go in the file (its type field first), instead of `value`'s."""


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    """GGUF order: the row length first."""
    kind: int = T_F32
    offset: int | None = None
    """Into the data region; None: laid out after the tensor before it."""
    size: int | None = None
    """Bytes written for it; None: what its type and shape need."""


@dataclass
class GGUFSpec:
    kvs: list[Kv]
    tensors: list[Tensor]
    magic: bytes = b"GGUF"
    version: int = 3
    alignment: int = 32
    """The layout's alignment (general.alignment, where the file states one, may say another)."""
    num_tensors: int | None = None
    num_kvs: int | None = None
    dims_override: dict[str, list[int]] = field(default_factory=dict)
    """A tensor's dimensions as written, whatever its layout used (ndims from the list's length)."""
    kind_override: dict[str, int] = field(default_factory=dict)


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value: Any, item_kind: int | None = None) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        assert item_kind is not None
        if item_kind == ARRAY:  # value: [(inner item kind, [items]), ...]
            items = b"".join(struct.pack("<I", inner) + _array_body(inner, v) for inner, v in value)
            return struct.pack("<IQ", ARRAY, len(value)) + items
        return struct.pack("<I", item_kind) + _array_body(item_kind, value)
    return struct.pack("<" + _FORMATS[kind], value)


def _array_body(item_kind: int, values: list[Any]) -> bytes:
    return struct.pack("<Q", len(values)) + b"".join(_value(item_kind, v) for v in values)


def build_gguf(spec: GGUFSpec) -> bytes:
    """The file's bytes: header, key-value pairs, tensor infos, padding, each tensor's data
    (deterministic values) padded to the alignment."""
    out = bytearray(spec.magic + struct.pack("<I", spec.version))
    out += struct.pack("<QQ", len(spec.tensors) if spec.num_tensors is None else spec.num_tensors,
                       len(spec.kvs) if spec.num_kvs is None else spec.num_kvs)  # fmt: skip
    for kv in spec.kvs:
        out += _string(kv.key)
        out += (
            kv.raw
            if kv.raw is not None
            else struct.pack("<I", kv.kind) + _value(kv.kind, kv.value, kv.item_kind)
        )
    align = spec.alignment
    offset, layout = 0, []
    for tensor in spec.tensors:
        block, type_size = _TYPE_SIZES[tensor.kind]
        size = tensor.size if tensor.size is not None else int(np.prod(tensor.shape)) // block * type_size
        start = offset if tensor.offset is None else tensor.offset
        layout.append((start, size))
        offset = start + -(-size // align) * align
        dims = spec.dims_override.get(tensor.name, list(tensor.shape))
        out += _string(tensor.name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        out += struct.pack("<IQ", spec.kind_override.get(tensor.name, tensor.kind), start)
    out += bytes(-len(out) % align)
    data_start = len(out)
    rng = np.random.default_rng(0)
    layout = [(start, size) for start, size in layout if start + size <= 2**26]  # none past a lie's end
    data = bytearray(max([start + size for start, size in layout], default=0))
    for start, size in layout:
        data[start : start + size] = (rng.standard_normal(size // 4 + 1).astype(np.float32) * 0.02).tobytes()[
            :size
        ]
    out += data
    out += bytes(-(len(out) - data_start) % align)
    return bytes(out)


def base_kvs(arch: str = "llama", layers: int = LAYERS) -> list[Kv]:
    p = f"{arch}."
    kvs = [
        Kv("general.architecture", STRING, arch),
        Kv(p + "block_count", U32, layers),
        Kv(p + "context_length", U32, 512),
        Kv(p + "embedding_length", U32, HIDDEN),
        Kv(p + "feed_forward_length", U32, INTERMEDIATE),
        Kv(p + "attention.head_count", U32, HEADS),
        Kv(p + "attention.head_count_kv", U32, KV_HEADS),
        Kv(p + "rope.dimension_count", U32, HEAD_DIM),
        Kv(p + "attention.layer_norm_rms_epsilon", F32, 1e-5),
        Kv(p + "rope.freq_base", F32, 10000.0),
        Kv("tokenizer.ggml.model", STRING, "gpt2"),
        Kv("tokenizer.ggml.tokens", ARRAY, [f"t{i}" for i in range(VOCAB)], STRING),
        Kv("tokenizer.ggml.bos_token_id", U32, 1),
        Kv("tokenizer.ggml.eos_token_id", U32, 2),
    ]
    if arch == "gemma3":
        kvs.append(Kv(p + "attention.sliding_window", U32, 8))
        kvs.append(Kv(p + "attention.key_length", U32, HEAD_DIM))
    return kvs


def base_tensors(arch: str = "llama", layers: int = LAYERS) -> list[Tensor]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = [Tensor("token_embd.weight", (HIDDEN, VOCAB)), Tensor("output_norm.weight", (HIDDEN,))]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [
            Tensor(b + "attn_norm.weight", (HIDDEN,)),
            Tensor(b + "attn_q.weight", (HIDDEN, q)),
            Tensor(b + "attn_k.weight", (HIDDEN, kv)),
            Tensor(b + "attn_v.weight", (HIDDEN, kv)),
            Tensor(b + "attn_output.weight", (q, HIDDEN)),
            Tensor(b + "ffn_norm.weight", (HIDDEN,)),
            Tensor(b + "ffn_gate.weight", (HIDDEN, INTERMEDIATE)),
            Tensor(b + "ffn_up.weight", (HIDDEN, INTERMEDIATE)),
            Tensor(b + "ffn_down.weight", (INTERMEDIATE, HIDDEN)),
        ]
        if arch == "gemma3":
            tensors += [
                Tensor(b + "attn_q_norm.weight", (HEAD_DIM,)),
                Tensor(b + "attn_k_norm.weight", (HEAD_DIM,)),
                Tensor(b + "post_attention_norm.weight", (HIDDEN,)),
                Tensor(b + "post_ffw_norm.weight", (HIDDEN,)),
            ]
    return tensors


def base_spec(arch: str = "llama") -> GGUFSpec:
    return GGUFSpec(base_kvs(arch), base_tensors(arch))


def _set(spec: GGUFSpec, key: str, kind: int, value: Any, item_kind: int | None = None) -> GGUFSpec:
    kvs = [kv for kv in spec.kvs if kv.key != key] + [Kv(key, kind, value, item_kind)]
    return replace(spec, kvs=kvs)


def _drop(spec: GGUFSpec, key: str) -> GGUFSpec:
    return replace(spec, kvs=[kv for kv in spec.kvs if kv.key != key])


def _raw(spec: GGUFSpec, key: str, raw: bytes) -> GGUFSpec:
    return replace(spec, kvs=[*[kv for kv in spec.kvs if kv.key != key], Kv(key, 0, None, raw=raw)])


def _tensor(spec: GGUFSpec, which: str, **changes: Any) -> GGUFSpec:
    return replace(spec, tensors=[replace(t, **changes) if t.name == which else t for t in spec.tensors])


def _layout_offset(spec: GGUFSpec, name: str) -> int:
    """Where the base layout puts tensor `name` in the data region."""
    offset = 0
    for tensor in spec.tensors:
        if tensor.name == name:
            return offset
        block, type_size = _TYPE_SIZES[tensor.kind]
        offset += -(-int(np.prod(tensor.shape)) // block * type_size // spec.alignment) * spec.alignment
    raise KeyError(name)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Path], Path]
    """Writes the damaged model under the folder given; returns what --model names."""
    expect: str
    """A pattern (re.search) the error line must hold: a field, a tensor, the problem."""


def _gguf_case(name: str, expect: str, spec: Callable[[], GGUFSpec] | None = None, **kw: Any) -> Case:
    def make(folder: Path) -> Path:
        data = kw["bytes"]() if "bytes" in kw else build_gguf(spec() if spec else base_spec())
        path = folder / f"{name}.gguf"
        path.write_bytes(data)
        return path

    return Case(f"gguf-{name}", make, expect)


def _truncated(at: Callable[[bytes], int]) -> Callable[[], bytes]:
    def cut() -> bytes:
        data = build_gguf(base_spec())
        return data[: at(data)]

    return cut


def _with_bytes(change: Callable[[bytearray], None]) -> Callable[[], bytes]:
    def changed() -> bytes:
        data = bytearray(build_gguf(base_spec()))
        change(data)
        return bytes(data)

    return changed


def _info_offset(data: bytes | bytearray, name: str) -> int:
    """Where tensor `name`'s info starts (its name's length field) in a built file."""
    needle = _string(name)
    return bytes(data).index(needle)


def _first_array_count(data: bytearray) -> int:
    """Offset of tokenizer.ggml.tokens' count field."""
    return bytes(data).index(_string("tokenizer.ggml.tokens")) + len(_string("tokenizer.ggml.tokens")) + 8


def _set_u64(data: bytearray, offset: int, value: int) -> None:
    data[offset : offset + 8] = struct.pack("<Q", value)


def _nested(depth: int) -> bytes:
    """An array of arrays `depth` levels deep (ARRAY type first), each holding one array."""
    raw = struct.pack("<I", ARRAY)
    for _ in range(depth - 1):
        raw += struct.pack("<IQ", ARRAY, 1)
    return raw + struct.pack("<IQ", U8, 1) + b"\x01"


def gguf_cases() -> list[Case]:
    s = base_spec
    p = "llama."
    last = "blk.1.ffn_down.weight"
    return [
        _gguf_case("empty", "too short", bytes=lambda: b""),
        _gguf_case("cut-in-header", "too short", bytes=_truncated(lambda d: 12)),
        _gguf_case("cut-in-counts", "tensor", bytes=_truncated(lambda d: 30)),
        _gguf_case("cut-in-metadata", "cannot fit", bytes=_truncated(lambda d: 200)),
        _gguf_case("cut-in-tokens", "tokenizer.ggml.tokens.*(truncated|cannot fit)", bytes=_truncated(lambda d: _first_array_count(bytearray(d)) + 1500)),
        _gguf_case("cut-in-tensor-infos", "tensor", bytes=_truncated(lambda d: _info_offset(d, "blk.1.attn_q.weight") + 20)),
        _gguf_case("cut-in-data", "run past the end", bytes=_truncated(lambda d: len(d) - 4096)),
        _gguf_case("cut-one-byte", "run past the end", bytes=_truncated(lambda d: len(d) - 1)),
        _gguf_case("magic", "not a GGUF", lambda: replace(s(), magic=b"GGML")),
        _gguf_case("version-0", "version 0", lambda: replace(s(), version=0)),
        _gguf_case("version-1", "version 1", lambda: replace(s(), version=1)),
        _gguf_case("version-99", "version 99", lambda: replace(s(), version=99)),
        _gguf_case("big-endian", "big-endian", lambda: replace(s(), version=3 << 24)),
        _gguf_case("tensor-count-2^62", "tensors", lambda: replace(s(), num_tensors=2**62)),
        _gguf_case("kv-count-2^62", "metadata keys", lambda: replace(s(), num_kvs=2**62)),
        _gguf_case("kv-count-one-more", "metadata|tensor", lambda: replace(s(), num_kvs=len(s().kvs) + 1)),
        _gguf_case("tensor-count-one-more", "tensor", lambda: replace(s(), num_tensors=len(s().tensors) + 1)),
        _gguf_case("key-length-2^62", "length", bytes=_with_bytes(lambda d: _set_u64(d, 24, 4611686018427387940))),
        _gguf_case("string-length-huge", "general.architecture", lambda: _raw(s(), "general.architecture", struct.pack("<IQ", STRING, 2**63) + b"llama")),
        _gguf_case("array-count-2^60", "tokenizer.ggml.tokens", bytes=_with_bytes(lambda d: _set_u64(d, _first_array_count(d), 2**60))),
        _gguf_case("u32-array-count-huge", "t.ints", lambda: _raw(s(), "t.ints", struct.pack("<IIQ", ARRAY, U32, 2**61) + bytes(8))),
        _gguf_case("array-item-string-length-huge", "tokenizer.ggml.tokens", bytes=_with_bytes(lambda d: _set_u64(d, _first_array_count(d) + 8, 2**62))),
        _gguf_case("long-array-string-length-huge", r"t\.long'\[4999\].*past the end", lambda: _raw(s(), "t.long", struct.pack("<IIQ", ARRAY, STRING, 5000) + _string("a") * 4999 + struct.pack("<Q", 2**62))),
        _gguf_case("nested-arrays-3", "nested", lambda: _raw(s(), "t.nested", _nested(3))),
        _gguf_case("nested-arrays-30000", "nested", lambda: _raw(s(), "t.nested", _nested(30000))),
        _gguf_case("nested-array-inner-count-huge", "t.nested", lambda: _raw(s(), "t.nested", struct.pack("<IIQ", ARRAY, ARRAY, 1) + struct.pack("<IQ", U8, 2**62))),
        _gguf_case("value-type-13", "unknown value type", lambda: _raw(s(), "t.odd", struct.pack("<I", 13) + bytes(8))),
        _gguf_case("array-item-type-99", "unknown item type", lambda: _raw(s(), "t.odd", struct.pack("<IIQ", ARRAY, 99, 1) + bytes(8))),
        _gguf_case("duplicate-key", "appears twice", lambda: replace(s(), kvs=[*s().kvs, Kv(p + "block_count", U32, 2)])),
        _gguf_case("alignment-0", "general.alignment", lambda: _set(s(), "general.alignment", U32, 0)),
        _gguf_case("alignment-3", "general.alignment", lambda: replace(_set(s(), "general.alignment", U32, 3), alignment=3)),
        _gguf_case("alignment-2^31", "general.alignment", lambda: _set(s(), "general.alignment", U32, 2**31)),
        _gguf_case("alignment-string", "general.alignment", lambda: _set(s(), "general.alignment", STRING, "32")),
        _gguf_case("alignment-4096-unpadded", "multiple of the alignment 4096", lambda: _set(s(), "general.alignment", U32, 4096)),
        _gguf_case("ndims-0", "dimensions", lambda: replace(s(), dims_override={last: []})),
        _gguf_case("ndims-5", "dimensions", lambda: replace(s(), dims_override={last: [128, 64, 1, 1, 1]})),
        _gguf_case("ndims-2^31", "dimensions", bytes=_with_bytes(lambda d: d.__setitem__(slice(_info_offset(d, last) + 8 + len(last), _info_offset(d, last) + 12 + len(last)), struct.pack("<I", 2**31)))),
        _gguf_case("dim-0", "shape", lambda: replace(s(), dims_override={last: [128, 0]})),
        _gguf_case("elements-overflow", "shape", lambda: replace(s(), dims_override={last: [2**40, 2**40]})),
        _gguf_case("elements-huge", last, lambda: replace(s(), dims_override={last: [128, 2**40]})),
        _gguf_case("tensor-type-99", "unknown tensor type", lambda: replace(s(), kind_override={last: 99})),
        _gguf_case("tensor-type-removed-4", "unknown tensor type", lambda: replace(s(), kind_override={last: 4})),
        _gguf_case("retyped-bigger", "attn_q.weight.*overlap", lambda: replace(s(), kind_override={"blk.0.attn_q.weight": 28})),
        _gguf_case("retyped-smaller", "attn_q.weight.*gap", lambda: replace(s(), kind_override={"blk.0.attn_q.weight": T_F16})),
        _gguf_case("retyped-last-bigger", "run past the end", lambda: replace(s(), kind_override={last: 28})),
        _gguf_case("retyped-q4-rows", "blocks of 32", lambda: replace(s(), kind_override={"output_norm.weight": T_Q4_0}, dims_override={"output_norm.weight": [48]})),
        _gguf_case("two-tensors-one-offset", "overlap", lambda: _tensor(s(), "blk.0.attn_k.weight", offset=_layout_offset(s(), "blk.0.attn_q.weight"))),
        _gguf_case("offset-unaligned", "alignment", lambda: _tensor(s(), last, offset=_layout_offset(s(), last) + 4)),
        _gguf_case("offset-past-end", last, lambda: _tensor(s(), last, offset=2**50)),
        _gguf_case("offset-max", last, lambda: _tensor(s(), last, offset=2**64 - 32)),
        _gguf_case("name-too-long", "at most 63", lambda: _tensor(s(), last, name="blk.1." + "x" * 100 + ".weight")),
        _gguf_case("name-length-huge", "length", bytes=_with_bytes(lambda d: _set_u64(d, _info_offset(d, last), 2**62))),
        _gguf_case("duplicate-tensor", "second tensor", lambda: _tensor(s(), "blk.1.attn_k.weight", name="blk.1.attn_q.weight")),
        # the metadata: fields beyond any model's, of the wrong type, missing, inconsistent
        _gguf_case("block-count-2e8", p + "block_count", lambda: _set(s(), p + "block_count", U32, 200_000_000)),
        _gguf_case("block-count-0", p + "block_count", lambda: _set(s(), p + "block_count", U32, 0)),
        _gguf_case("block-count-string", p + "block_count", lambda: _set(s(), p + "block_count", STRING, "2")),
        _gguf_case("block-count-float", p + "block_count", lambda: _set(s(), p + "block_count", F32, 2.0)),
        _gguf_case("block-count-missing", p + "block_count", lambda: _drop(s(), p + "block_count")),
        _gguf_case("block-count-3-of-2", "layer 2", lambda: _set(s(), p + "block_count", U32, 3)),
        _gguf_case("block-count-1-of-2", "blk.1", lambda: _set(s(), p + "block_count", U32, 1)),
        _gguf_case("hidden-128-of-64", "token_embd.weight", lambda: _set(s(), p + "embedding_length", U32, 128)),
        _gguf_case("hidden-2^40", p + "embedding_length", lambda: _set(s(), p + "embedding_length", U64, 2**40)),
        _gguf_case("vocab-2^31", p + "vocab_size", lambda: _set(s(), p + "vocab_size", U32, 2**31)),
        _gguf_case("vocab-300-of-256", "token_embd.weight", lambda: _set(s(), p + "vocab_size", U32, 300)),
        _gguf_case("heads-0", p + "attention.head_count", lambda: _set(s(), p + "attention.head_count", U32, 0)),
        _gguf_case("heads-5-not-dividing", p + "embedding_length", lambda: _set(_drop(s(), p + "rope.dimension_count"), p + "attention.head_count", U32, 5)),
        _gguf_case("kv-heads-3-not-dividing", "num_key_value_heads", lambda: _set(s(), p + "attention.head_count_kv", U32, 3)),
        _gguf_case("head-dim-2^20", p + "attention.key_length", lambda: _set(s(), p + "attention.key_length", U32, 2**20)),
        _gguf_case("context-2^40", p + "context_length", lambda: _set(s(), p + "context_length", U64, 2**40)),
        _gguf_case("ffn-missing", p + "feed_forward_length", lambda: _drop(s(), p + "feed_forward_length")),
        _gguf_case("ffn-mismatch", "ffn_gate", lambda: _set(s(), p + "feed_forward_length", U32, 96)),
        _gguf_case("eps-negative", p + "attention.layer_norm_rms_epsilon", lambda: _set(s(), p + "attention.layer_norm_rms_epsilon", F32, -1.0)),
        _gguf_case("eps-nan", p + "attention.layer_norm_rms_epsilon", lambda: _set(s(), p + "attention.layer_norm_rms_epsilon", F32, float("nan"))),
        _gguf_case("rope-base-inf", p + "rope.freq_base", lambda: _set(s(), p + "rope.freq_base", F32, float("inf"))),
        _gguf_case("rope-linear-no-factor", p + "rope.scaling.factor", lambda: _set(s(), p + "rope.scaling.type", STRING, "linear")),
        _gguf_case("rope-factor-string", p + "rope.scaling.factor", lambda: _set(_set(s(), p + "rope.scaling.type", STRING, "linear"), p + "rope.scaling.factor", STRING, "8")),
        _gguf_case("rope-yarn", p + "rope.scaling.type", lambda: _set(s(), p + "rope.scaling.type", STRING, "yarn")),
        _gguf_case("rope-freqs-wrong-length", "rope_freq", lambda: replace(s(), tensors=[*s().tensors, Tensor("rope_freqs.weight", (5,))])),
        _gguf_case("bos-outside-vocab", "tokenizer.ggml.bos_token_id", lambda: _set(s(), "tokenizer.ggml.bos_token_id", U32, 1000)),
        _gguf_case("eos-negative", "tokenizer.ggml.eos_token_id", lambda: _set(s(), "tokenizer.ggml.eos_token_id", I32, -1)),
        _gguf_case("eos-string", "tokenizer.ggml.eos_token_id", lambda: _set(s(), "tokenizer.ggml.eos_token_id", STRING, "2")),
        _gguf_case("no-tokens-no-vocab", "vocab", lambda: _drop(s(), "tokenizer.ggml.tokens")),
        _gguf_case("architecture-unknown", "general.architecture", lambda: _set(s(), "general.architecture", STRING, "gpt99")),
        _gguf_case("architecture-missing", "general.architecture", lambda: _drop(s(), "general.architecture")),
        _gguf_case("architecture-int", "general.architecture", lambda: _set(s(), "general.architecture", U32, 7)),
        _gguf_case("tensor-unknown", "blk.0.attn_x.weight", lambda: _tensor(s(), "blk.0.attn_q.weight", name="blk.0.attn_x.weight")),
        _gguf_case("tensor-layer-not-a-number", "blk.x.attn_q.weight", lambda: _tensor(s(), "blk.0.attn_q.weight", name="blk.x.attn_q.weight")),
        _gguf_case("tensor-short-name", "'blk'", lambda: _tensor(s(), "blk.0.attn_q.weight", name="blk")),
        _gguf_case("token-embd-missing", "token embedding", lambda: replace(s(), tensors=[t for t in s().tensors if t.name != "token_embd.weight"])),
        _gguf_case("attn-q-shape", "blk.0.attn_q.weight", lambda: _tensor(s(), "blk.0.attn_q.weight", shape=(HIDDEN, 32))),
        _gguf_case("gemma3-block-count-2e8", "gemma3.block_count", lambda: _set(base_spec("gemma3"), "gemma3.block_count", U32, 200_000_000)),
        _gguf_case("gemma3-window-pattern-0", "sliding_window_pattern", lambda: _set(base_spec("gemma3"), "gemma3.attention.sliding_window_pattern", U32, 0)),
        _gguf_case("gemma3-window-pattern-list", "sliding_window_pattern", lambda: _set(base_spec("gemma3"), "gemma3.attention.sliding_window_pattern", ARRAY, [True] * 5, BOOL)),
        _gguf_case("gemma3-window-missing", "gemma3.attention.sliding_window", lambda: _drop(base_spec("gemma3"), "gemma3.attention.sliding_window")),
    ]  # fmt: skip


# Hugging Face folders: config.json + model.safetensors (+ generation_config.json)

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def hf_tensors(config: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    c = BASE_CONFIG | (config or {})
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": w(h)}
    for n in range(layers):
        b = f"model.layers.{n}."
        tensors |= {
            b + "input_layernorm.weight": w(h),
            b + "post_attention_layernorm.weight": w(h),
            b + "self_attn.q_proj.weight": w(q, h),
            b + "self_attn.k_proj.weight": w(kv, h),
            b + "self_attn.v_proj.weight": w(kv, h),
            b + "self_attn.o_proj.weight": w(h, q),
            b + "mlp.gate_proj.weight": w(i, h),
            b + "mlp.up_proj.weight": w(i, h),
            b + "mlp.down_proj.weight": w(h, i),
        }
    return tensors


def write_hf(
    folder: Path, config: Any = None, text: str | bytes | None = None, tensors: dict | None = None
) -> Path:
    """A tiny Llama folder: `config` (else the base's) as config.json, or `text` as it is."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if text is None:
        text = json.dumps(BASE_CONFIG if config is None else config)
    (folder / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
    save_file(hf_tensors() if tensors is None else tensors, str(folder / "model.safetensors"))
    return folder


def _hf_case(name: str, expect: str, make: Callable[[Path], Path]) -> Case:
    return Case(f"hf-{name}", lambda folder: make(folder / name), expect)


def _config(**changes: Any) -> Callable[[Path], Path]:
    return lambda folder: write_hf(
        folder, {k: v for k, v in (BASE_CONFIG | changes).items() if v is not _DROP}
    )


_DROP = object()


def _safetensors(change: Callable[[bytearray], bytes]) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        write_hf(folder)
        path = folder / "model.safetensors"
        path.write_bytes(change(bytearray(path.read_bytes())))
        return folder

    return make


def _header(data: bytearray) -> tuple[int, dict]:
    (length,) = struct.unpack_from("<Q", data, 0)
    return length, json.loads(bytes(data[8 : 8 + length]))


def _rewrite_header(edit: Callable[[dict], None]) -> Callable[[bytearray], bytes]:
    def change(data: bytearray) -> bytes:
        length, header = _header(data)
        edit(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + bytes(data[8 + length :])

    return change


def _generation(folder: Path, text: str) -> Path:
    write_hf(folder)
    (folder / "generation_config.json").write_text(text)
    return folder


def _gemma_multimodal(folder: Path) -> Path:
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 1_000_000_000, "hidden_size": HIDDEN},
    }
    return write_hf(folder, config)


def hf_cases() -> list[Case]:
    embed = "model.embed_tokens.weight"
    return [
        _hf_case("layers-1e9", "num_hidden_layers", _config(num_hidden_layers=1_000_000_000)),
        _hf_case("layers-2e8", "num_hidden_layers", _config(num_hidden_layers=200_000_000)),
        _hf_case("layers-negative", "num_hidden_layers", _config(num_hidden_layers=-2)),
        _hf_case("layers-string", "num_hidden_layers", _config(num_hidden_layers="2")),
        _hf_case("layers-float", "num_hidden_layers", _config(num_hidden_layers=2.5)),
        _hf_case("layers-bool", "num_hidden_layers", _config(num_hidden_layers=True)),
        _hf_case("layers-3-of-2", "layer 2", _config(num_hidden_layers=3)),
        _hf_case("layers-1-of-2", "model.layers.1", _config(num_hidden_layers=1)),
        _hf_case("vocab-2^31", "vocab_size", _config(vocab_size=2**31)),
        _hf_case("vocab-512-of-256", embed, _config(vocab_size=512)),
        _hf_case("hidden-missing", "hidden_size", _config(hidden_size=_DROP)),
        _hf_case("hidden-2^40", "hidden_size", _config(hidden_size=2**40)),
        _hf_case("hidden-128-of-64", "has shape", _config(hidden_size=128)),
        _hf_case("heads-not-dividing", "num_attention_heads", _config(num_attention_heads=5)),
        _hf_case("heads-0", "num_attention_heads", _config(num_attention_heads=0)),
        _hf_case("kv-heads-3", "num_key_value_heads", _config(num_key_value_heads=3)),
        _hf_case("head-dim-odd", "head_dim", _config(head_dim=15)),
        _hf_case("context-2^40", "max_position_embeddings", _config(max_position_embeddings=2**40)),
        _hf_case("eps-nan", "rms_norm_eps", _config(rms_norm_eps=float("nan"))),
        _hf_case("eps-string", "rms_norm_eps", _config(rms_norm_eps="1e-5")),
        _hf_case("rope-theta-negative", "rope_theta", _config(rope_theta=-1.0)),
        _hf_case("bos-outside-vocab", "bos_token_id", _config(bos_token_id=1000)),
        _hf_case("eos-list-outside-vocab", "eos_token_id", _config(eos_token_id=[2, 2**40])),
        _hf_case("torch-dtype-float1024", "float1024", _config(torch_dtype="float1024")),
        _hf_case("dtype-list", "dtype", _config(torch_dtype=None, dtype=["float32"])),
        _hf_case("rope-linear-no-factor", "rope_scaling.factor", _config(rope_scaling={"rope_type": "linear"})),
        _hf_case("rope-factor-string", "rope_scaling.factor", _config(rope_scaling={"rope_type": "linear", "factor": "8"})),
        _hf_case("rope-llama3-missing", "low_freq_factor", _config(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
        _hf_case("rope-yarn", "yarn", _config(rope_scaling={"type": "yarn", "factor": 4.0})),
        _hf_case("rope-scaling-list", "rope_scaling", _config(rope_scaling=[1, 2])),
        _hf_case("tie-string", "tie_word_embeddings", _config(tie_word_embeddings="yes")),
        _hf_case("architecture-unknown", "not supported", _config(architectures=["GPT99ForCausalLM"])),
        _hf_case("architectures-string", "architectures", _config(architectures="LlamaForCausalLM")),
        _hf_case("mistral-window-0", "sliding_window", _config(architectures=["MistralForCausalLM"], sliding_window=0)),
        _hf_case("qwen2-layer-types-long", "layer_types", _config(architectures=["Qwen2ForCausalLM"], layer_types=["full_attention"] * 5)),
        _hf_case("gemma3-window-pattern-0", "sliding_window_pattern", _config(architectures=["Gemma3ForCausalLM"], sliding_window_pattern=0, head_dim=16, sliding_window=8)),
        _hf_case("gemma3-multimodal-layers-1e9", "num_hidden_layers", _gemma_multimodal),
        _hf_case("config-not-json", "not valid JSON", lambda f: write_hf(f, text="{not json")),
        _hf_case("config-not-utf8", "not valid JSON", lambda f: write_hf(f, text=b"\xff\xfe{")),
        _hf_case("config-a-list", "not a JSON object", lambda f: write_hf(f, text="[1, 2]")),
        _hf_case("config-nested-100000", "not valid JSON", lambda f: write_hf(f, text="[" * 100_000 + "]" * 100_000)),
        _hf_case("generation-eos-outside", "eos_token_id", lambda f: _generation(f, '{"eos_token_id": [2, 99999]}')),
        _hf_case("generation-not-json", "generation_config.json", lambda f: _generation(f, "{")),
        _hf_case("safetensors-empty", "too short", _safetensors(lambda d: b"")),
        _hf_case("safetensors-truncated", "data_offsets", _safetensors(lambda d: bytes(d[: len(d) // 2]))),
        _hf_case("safetensors-header-length-huge", "header length", _safetensors(lambda d: struct.pack("<Q", 2**62) + bytes(d[8:]))),
        _hf_case("safetensors-header-not-json", "not JSON", _safetensors(lambda d: bytes(d[:8]) + b"x" * 16 + bytes(d[24:]))),
        _hf_case("safetensors-offsets-outside", "data_offsets", _safetensors(_rewrite_header(lambda h: h[embed].update(data_offsets=[0, 2**40])))),
        _hf_case("safetensors-dtype-unknown", "unknown dtype", _safetensors(_rewrite_header(lambda h: h[embed].update(dtype="F1024")))),
        _hf_case("safetensors-shape-lies", "bytes for", _safetensors(_rewrite_header(lambda h: h[embed].update(shape=[2**31, 64])))),
        _hf_case("safetensors-no-embedding", "token embedding", lambda f: write_hf(f, tensors={k: v for k, v in hf_tensors().items() if k != embed})),
    ]  # fmt: skip


def all_cases() -> list[Case]:
    return gguf_cases() + hf_cases()
