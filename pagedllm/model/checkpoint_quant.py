"""Quantized safetensors checkpoints as vLLM serves them: AWQ, GPTQ and compressed-tensors (int
weights: W8A8's int8, W4A16's packed int4), kept quantized in the block form the integer kernel
packs (layers/quantization.py). Each method reads its quantization_config into a
CheckpointQuantization in its own module (quantization/awq.py, gptq.py, compressed_tensors.py);
the tensors of all three are read here.

Each scheme stores, per projection, integer codes, a scale per group of inputs and a zero point:
W = scale * (code - zero). A group of G inputs becomes G / 32 blocks sharing its scale, with
min = -scale * zero, so reading loses nothing (float16 and bfloat16 scales; float32 ones round
once more). Packing then rounds a min to float16 unless every block's zero is the same (GPTQ's
and compressed-tensors' symmetric 8, folded into the codes): AWQ's per-group zeros cost it 5
bits a weight and that rounding, as Q4_1's mins do. Act-order checkpoints (GPTQ desc_act),
whose groups are not runs of inputs, and groups that are not whole blocks are dequantized to
float at load instead. Tensors a scheme leaves alone (embeddings, norms, the LM head) pass through.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.layers.quantization import BLOCK, BlockQuantized, EncodedRows, packed_bits_per_weight

logger = logging.getLogger(__name__)

AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's GEMM packing: nibble i of a packed word holds output column 8c + AWQ_COLUMN_OF_NIBBLE[i]."""
_AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_COLUMN_OF_NIBBLE.index(column) for column in range(8))

_IGNORED_PARTS = ("input_scale", "input_zero_point", "output_scale", "weight_shape", "k_scale", "v_scale")
"""Tensors read and dropped: static activation and KV scales (the kernel quantizes activations
as it computes, per block of 32 or per token; the KV cache has --kv-cache-dtype), and the shape
of a packed weight (known from its scales)."""


@dataclass(frozen=True)
class Scheme:
    """How one projection's weight is stored."""

    layout: str
    """awq, gptq (zeros stored minus one), gptq_v2, ct-packed (int32 words along inputs, codes
    offset by half their range) or ct-int (one int8 per code); fp8, whose tensors
    quantization/fp8.py reads (its scheme says how they are held: 8-bit blocks of 32)."""
    bits: int
    group_size: int
    """Inputs per scale; -1: the whole row."""
    symmetric: bool
    """Every zero the middle of the codes' range (compressed-tensors then stores none)."""
    act_order: bool = False
    """Each input's group given by g_idx rather than by its position."""
    per_token: bool = False
    """Activations quantized to int8 per token with dynamic scales (W8A8) over weights with one
    scale per column: the kernel computes that scheme as it is. Other activation schemes (static
    scales) are computed per block of 32, the finer."""

    @property
    def parts(self) -> frozenset[str]:
        """The tensor names (after the module's) that make up one weight."""
        if self.layout in ("awq", "gptq", "gptq_v2"):
            names = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.act_order else set())
        else:
            names = {"weight_packed" if self.layout == "ct-packed" else "weight", "weight_scale"}
            names |= set() if self.symmetric else {"weight_zero_point"}
            names |= {"weight_g_idx"} if self.act_order else set()
        return frozenset(names)

    @property
    def packed_bits(self) -> float | None:
        """Bits a weight as the integer kernel holds it; None where it is held as float."""
        if self.act_order or (self.group_size != -1 and self.group_size % BLOCK):
            return None
        return packed_bits_per_weight(self.bits, has_mins=not self.symmetric)


@dataclass(frozen=True)
class CheckpointQuantization:
    """config.json's quantization_config, read: the method and the scheme of each projection."""

    method: str
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]
    """(targets, scheme) in order; the first whose target matches a module applies."""
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> Scheme | None:
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        return next((s for targets, s in self.groups if any(_matches(t, module) for t in targets)), None)

    def format(self, scheme: Scheme) -> str:
        """The name the start-up line and `pagedllm plan` give these weights."""
        return f"{self.method} int{scheme.bits}"


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' targets: a class name (every projection here is a Linear), `re:` and a
    pattern matched at the start of the module's name, or the name itself."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target


def group_size(value: Any, method: str) -> int:
    """quantization_config's group_size: inputs per scale, -1 for the whole row."""
    group = -1 if value in (None, -1, 0) else value
    if not isinstance(group, int) or (group != -1 and group < 1):
        raise ValueError(f"quantization_config ({method}): group_size {value!r} is not a group size")
    return group


def not_converted(config: dict[str, Any]) -> tuple[str, ...]:
    """AutoAWQ's and GPTQModel's modules left float: any module whose name holds one (their rule)."""
    return tuple(f"re:.*{re.escape(name)}" for name in config.get("modules_to_not_convert") or ())


def iter_checkpoint_weights(
    tensors: Iterable[tuple[str, torch.Tensor]], quantization: CheckpointQuantization
) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """The checkpoint's tensors with each quantized projection's parts read into one
    `MODULE.weight`: BlockQuantized, or float where its groups are not runs of whole blocks.
    Other tensors pass through; a projection missing a part is a ValueError."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    held_as_float: dict[str, int] = {}  # why -> how many projections
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in _IGNORED_PARTS:
            continue
        scheme = quantization.scheme_for(module)
        quantized_part = scheme is not None and leaf in scheme.parts
        if scheme is not None and leaf == "weight" and scheme.layout == "ct-int":
            quantized_part = not tensor.is_floating_point()  # a projection left float keeps its name
        if not quantized_part:
            if scheme is not None and leaf == "g_idx":
                continue  # positional groups (desc_act off): the order is the inputs'
            yield name, tensor
            continue
        assert scheme is not None
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if parts.keys() >= scheme.parts:
            del pending[module]
            weight, why_float = _read_weight(parts, scheme, quantization.format(scheme), module)
            if why_float:
                held_as_float[why_float] = held_as_float.get(why_float, 0) + 1
            yield f"{module}.weight", weight
    for why, count in held_as_float.items():
        logger.info(
            "%d projections dequantized to float at load: %s (the integer kernel takes groups of "
            "whole blocks of %d inputs, in order)",
            count,
            why,
            BLOCK,
        )
    if pending:
        module, parts = next(iter(pending.items()))
        scheme = quantization.scheme_for(module)
        missing = sorted(scheme.parts - parts.keys()) if scheme else []
        raise ValueError(f"quantized checkpoint: {module} lacks {', '.join(missing)}")


def _read_weight(
    parts: dict[str, torch.Tensor], scheme: Scheme, format: str, module: str
) -> tuple[torch.Tensor | BlockQuantized, str]:
    """One projection's parts -> W[N, K] as codes, scales and zeros, kept encoded per row; or
    float, with the reason (empty when kept quantized)."""
    try:
        codes, scales, zeros, groups_of_inputs = _codes_scales_zeros(parts, scheme)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"quantized checkpoint: {module}: {err}") from None
    k = codes.shape[1]
    group = k // scales.shape[1]
    positional = groups_of_inputs is None or torch.equal(groups_of_inputs.long(), torch.arange(k) // group)
    if not positional or group % BLOCK:
        index = groups_of_inputs.long() if groups_of_inputs is not None else torch.arange(k) // group
        why = "act-order groups" if not positional else f"groups of {group} inputs"
        return scales[:, index] * (codes.float() - zeros[:, index]), why
    raw = _encode_rows(codes, scales, zeros, scheme.bits)
    encoding = f"{format}, groups of {group}"  # rows join only with rows of the same layout
    decode = functools.partial(_decode_rows, k=k, bits=scheme.bits, format=format)
    encoded = EncodedRows(raw, encoding, decode)
    return BlockQuantized.from_encoded(encoded, k, scheme.bits, format, scheme.per_token), ""


def _codes_scales_zeros(
    parts: dict[str, torch.Tensor], scheme: Scheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """codes (uint8, [N, K], 0 .. 2^bits - 1), scales (float32, [N, groups]), zeros (float32, the
    codes' domain, [N, groups]) and each input's group where the scheme says it (act order)."""
    bits, half = scheme.bits, 1 << (scheme.bits - 1)
    if scheme.layout == "awq":
        codes = _unpack(parts["qweight"], bits, dim=1, nibble_order=_AWQ_NIBBLE_OF_COLUMN).T
        zeros = _unpack(parts["qzeros"], bits, dim=1, nibble_order=_AWQ_NIBBLE_OF_COLUMN).T.float()
        scales = parts["scales"].T.float()
    elif scheme.layout in ("gptq", "gptq_v2"):
        codes = _unpack(parts["qweight"], bits, dim=0).T
        zeros = _unpack(parts["qzeros"], bits, dim=1).T.float()
        zeros = zeros + 1 if scheme.layout == "gptq" else zeros  # v1 stores each zero minus one
        scales = parts["scales"].T.float()
    else:
        if scheme.layout == "ct-packed":
            codes = _unpack(parts["weight_packed"], bits, dim=1)
        else:
            codes = (parts["weight"].to(torch.int16) + half).to(torch.uint8)
        scales = parts["weight_scale"].float().reshape(-1, parts["weight_scale"].shape[-1])
        scales = scales.expand(codes.shape[0], -1) if scales.shape[0] == 1 else scales
        zero_point = parts.get("weight_zero_point")
        if zero_point is None:
            zeros = torch.full_like(scales, float(half))
        elif zero_point.dtype == torch.int32 and zero_point.shape[0] != scales.shape[0]:
            zeros = _unpack(zero_point, bits, dim=0)[: scales.shape[0]].float()  # packed, offset
        else:
            zeros = zero_point.float().reshape(scales.shape) + half
    n, k = codes.shape
    if scales.shape[0] != n or zeros.shape != scales.shape or k % scales.shape[1]:
        raise ValueError(
            f"codes [{n}, {k}] with scales {list(scales.shape)} and zero points {list(zeros.shape)} "
            "do not make groups of inputs"
        )
    groups_of_inputs = parts.get("g_idx", parts.get("weight_g_idx"))
    return codes, scales, zeros, groups_of_inputs


def _unpack(
    packed: torch.Tensor, bits: int, dim: int, nibble_order: tuple[int, ...] = tuple(range(8))
) -> torch.Tensor:
    """int32 words holding 32 / bits codes each along `dim` -> uint8 codes; at 4 bits the i-th
    code of a word is its nibble nibble_order[i] (the lowest is 0). Read byte by byte (the
    words' bytes in memory, lowest first on this little-endian host), so a weight costs a byte
    of scratch, not four, and AWQ's interleave costs no gather of its own."""
    rows, columns = packed.shape
    codes = packed.to(torch.int32).contiguous().view(torch.uint8).view(rows, columns, 4)
    if bits == 4:
        low, high = codes & 15, codes >> 4
        nibbles = [(high if i % 2 else low)[:, :, i // 2] for i in nibble_order]
        codes = torch.stack(nibbles, dim=-1)
    if dim == 1:
        return codes.reshape(rows, -1)
    return codes.permute(0, 2, 1).reshape(-1, columns)


def _encode_rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, row bytes]: a row's codes (two a byte at 4 bits, the lower first), then its
    scales and zeros as float32. Rows stay whole, so slicing and joining by rows work on these
    bytes, and a model loads in about its file's size."""
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    floats = torch.cat([scales.float(), zeros.float()], dim=1).contiguous()
    return torch.cat([codes, floats.view(torch.uint8)], dim=1)


def _decode_rows(raw: torch.Tensor, k: int, bits: int, format: str) -> BlockQuantized:
    """_encode_rows' bytes -> W = scales * q + mins per block of 32."""
    n = raw.shape[0]
    code_bytes = k * bits // 8
    codes = raw[:, :code_bytes]
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).view(n, k)
    floats = raw[:, code_bytes:].contiguous().view(torch.float32)
    groups = floats.shape[1] // 2
    per_group = k // BLOCK // groups
    scales = floats[:, :groups].repeat_interleave(per_group, dim=1).contiguous()
    zeros = floats[:, groups:].repeat_interleave(per_group, dim=1)
    if bits == 4:
        return BlockQuantized(codes.to(torch.int8), scales, -scales * zeros, 4, format)
    q = (codes.to(torch.int16) - 128).to(torch.int8)
    mins = None if bool((zeros == 128).all()) else scales * (128 - zeros)
    return BlockQuantized(q, scales, mins, 8, format)
