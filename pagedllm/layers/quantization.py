"""Weights kept quantized: one form for every block format, and how a projection computes from it.

A quantized [N, K] weight is `scales * q + mins` per block of 32 inputs (BlockQuantized): GGUF's
Q8_0 (mins none), Q4_0 (mins = -8 scales), Q4_1 and Q4_K's sub-blocks all read into it without
loss (model/gguf_weights.py), and `--quantization int8|int4` quantizes a float checkpoint into it
at load. Split and fused projections slice and join it by whole rows (and by whole blocks of
columns) before it is packed, so tensor parallelism and fused q/k/v work as with float weights.

On a CPU with the integer kernel (kernels/csrc/quant_linear_cpu.cpp) a projection streams the
packed blocks and never holds a float copy; elsewhere (no compiler, CUDA) it is dequantized once
to the model's dtype at load, so the same checkpoint runs everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from pagedllm.kernels import cpu_ops

BLOCK = 32
"""Inputs per block: each block of a row has its own scale (and min)."""


def packed_bits_per_weight(bits: int, has_mins: bool) -> float:
    """Bytes x 8 per weight as the integer kernel holds them (kernels/csrc/quant_linear_cpu.cpp):
    the codes, one float16 scale per block, and a float16 min per block where the mins are not a
    whole multiple of the scales (Q4_0's -8 x scale folds into the codes, Q4_1's mins do not)."""
    return bits + 16 / BLOCK * (2 if has_mins else 1)


@dataclasses.dataclass
class EncodedRows:
    """A weight's rows as a file stores them (uint8 [N, row bytes], e.g. a view of a mapped GGUF)
    and the function that reads them out: rows are chosen and joined on these bytes, so nothing
    is spelled out until it is needed, and a kernel that knows the encoding packs from them."""

    raw: torch.Tensor
    encoding: str
    """The file's name for it (GGUF's Q4_0, Q4_K, ...)."""
    decode: Callable[[torch.Tensor], BlockQuantized]
    """raw rows -> the same rows as codes, scales and mins."""
    release: tuple[Callable[[], None], ...] = ()
    """Each lets the file's memory under these rows go, once they are packed or copied."""


class BlockQuantized:
    """W[n, k] = scales[n, k // 32] * q[n, k] + mins[n, k // 32].

    Made from codes, scales and mins, or (from_encoded) from a file's rows still encoded: those are
    read out on first use of q, scales or mins, one weight at a time, so a model loads without a
    byte per weight of codes for all of it at once."""

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bits: int,
        format: str,
        per_token: bool = False,
    ) -> None:
        n, k = q.shape
        if k % BLOCK or scales.shape != (n, k // BLOCK):
            raise ValueError(
                f"quantized weight [{n}, {k}]: K must be a multiple of {BLOCK}, scales [N, K/{BLOCK}]"
            )
        self._q: torch.Tensor | None = q
        self._scales: torch.Tensor | None = scales
        self._mins = mins
        self._shape = q.shape
        self.bits = bits
        self.format = format
        """Where it came from, for the start-up report: a GGUF type name (Q4_K) or int8/int4."""
        self.per_token = per_token
        """Its inputs are quantized with one scale per row, not per block: a W8A8 checkpoint's
        dynamic per-token scheme, which the kernel computes as it is (8 bits, one scale per
        column, no mins), summing over all of K before any float work."""
        self.encoded: EncodedRows | None = None

    @classmethod
    def from_encoded(
        cls, encoded: EncodedRows, columns: int, bits: int, format: str, per_token: bool = False
    ) -> BlockQuantized:
        """Rows still encoded, `columns` values each, read out as `bits`-bit codes when used."""
        weight = cls.__new__(cls)
        weight._q = weight._scales = weight._mins = None
        weight._shape = torch.Size((encoded.raw.shape[0], columns))
        weight.bits, weight.format, weight.encoded, weight.per_token = bits, format, encoded, per_token
        return weight

    @property
    def q(self) -> torch.Tensor:
        """int8 [N, K]: 0..15 for 4 bits, -128..127 for 8."""
        return self._read_out()[0]

    @property
    def scales(self) -> torch.Tensor:
        """float32 [N, K // 32]."""
        return self._read_out()[1]

    @property
    def mins(self) -> torch.Tensor | None:
        """float32 [N, K // 32], or None for none (symmetric formats)."""
        return self._read_out()[2]

    def _read_out(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._q is None or self._scales is None:
            assert self.encoded is not None
            decoded = self.encoded.decode(self.encoded.raw)
            self._q, self._scales, self._mins = decoded.q, decoded.scales, decoded.mins
        return self._q, self._scales, self._mins

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def release_file_pages(self) -> None:
        """Done with the file's bytes: let the memory mapping them go (read again if used)."""
        if self.encoded is not None:
            for release in self.encoded.release:
                release()

    @property
    def still_encoded(self) -> EncodedRows | None:
        """The file's rows, while they are not read out (a kernel may pack from them)."""
        return self.encoded if self._q is None else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (float32 arithmetic, then `dtype`). A GGUF's rows still
        encoded are read out by the kernel an embedding's lookup uses, in one pass on every core,
        the same values: a float model's load from a GGUF costs a read of the file, not a pass over
        a byte per weight of codes and another over their floats."""
        n, k = self.shape
        encoded = self.still_encoded
        if encoded is not None and encoded.encoding in cpu_ops.GGUF_PACKED_FORMATS and cpu_ops.is_built():
            return cpu_ops.gguf_rows(encoded.raw, torch.arange(n), encoded.encoding, k).to(dtype)
        blocks = self.q.view(n, k // BLOCK, BLOCK).float() * self.scales.unsqueeze(-1)
        if self.mins is not None:
            blocks = blocks + self.mins.unsqueeze(-1)
        return blocks.view(n, k).to(dtype)

    def rows(self, start: int, length: int) -> BlockQuantized:
        """Output rows start .. start + length (a column-parallel rank's share)."""
        return self._map(lambda t: t.narrow(0, start, length))

    def columns(self, start: int, length: int) -> BlockQuantized:
        """Inputs start .. start + length, whole blocks only (a row-parallel rank's share)."""
        if start % BLOCK or length % BLOCK:
            raise ValueError(
                f"a quantized weight splits by whole blocks of {BLOCK} inputs, not at {start}+{length}"
            )
        q = self.q.narrow(1, start, length)
        scales = self.scales.narrow(1, start // BLOCK, length // BLOCK)
        mins = self.mins
        mins = None if mins is None else mins.narrow(1, start // BLOCK, length // BLOCK)
        return BlockQuantized(
            q.contiguous(),
            scales.contiguous(),
            mins if mins is None else mins.contiguous(),
            self.bits,
            self.format,
            self.per_token,
        )

    def permute_rows(self, order: torch.Tensor) -> BlockQuantized:
        """Rows in `order` (llama.cpp's rotary row order undone)."""
        return self._map(lambda t: t.index_select(0, order))

    def to_bits(self, bits: int) -> BlockQuantized:
        """The same weights in a wider form: 4-bit q (0..15) as 8-bit q - 8, the 8 folded into mins."""
        if bits == self.bits:
            return self
        assert self.bits == 4 and bits == 8, "only 4 -> 8 bits widens without loss"
        mins = (self.mins if self.mins is not None else torch.zeros_like(self.scales)).double()
        return BlockQuantized(
            self.q - 8, self.scales, (mins + 8 * self.scales.double()).float(), 8, self.format
        )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockQuantized:
        """The same rows `fn` picks, of the encoded bytes while they are not read out."""
        if (encoded := self.still_encoded) is not None:
            encoded = dataclasses.replace(encoded, raw=fn(encoded.raw).contiguous())
            return BlockQuantized.from_encoded(encoded, self.shape[1], self.bits, self.format, self.per_token)
        mins = self.mins
        return BlockQuantized(
            fn(self.q).contiguous(),
            fn(self.scales).contiguous(),
            None if mins is None else fn(mins).contiguous(),
            self.bits,
            self.format,
            self.per_token,
        )


def join_rows(parts: Sequence[BlockQuantized]) -> BlockQuantized:
    """Parts stacked by output rows (q/k/v into qkv), widened to the widest part's bits; their
    inputs quantized per token only where every part's are (per block is the finer)."""
    if len(parts) == 1:
        return parts[0]
    per_token = all(part.per_token for part in parts)
    encoded = [e for part in parts if (e := part.still_encoded) is not None]
    if len(encoded) == len(parts) and len({e.encoding for e in encoded}) == 1:
        raw = torch.cat([e.raw for e in encoded])
        releases = tuple(release for e in encoded for release in e.release)
        joined = dataclasses.replace(encoded[0], raw=raw, release=releases)
        return BlockQuantized.from_encoded(
            joined, parts[0].shape[1], parts[0].bits, parts[0].format, per_token
        )
    bits = max(part.bits for part in parts)
    parts = [part.to_bits(bits) for part in parts]
    any_mins = any(part.mins is not None for part in parts)
    mins = (
        torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
        if any_mins
        else None
    )
    formats = sorted({part.format for part in parts})
    q, scales = torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts])
    return BlockQuantized(q, scales, mins, bits, "+".join(formats), per_token and mins is None)


def quantize(weight: torch.Tensor, bits: int) -> BlockQuantized:
    """A float [N, K] weight, per block of 32: 8 bits symmetric (as GGUF's Q8_0), or 4 bits from
    the block's min to its max (as Q4_1). Round to nearest."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if bits == 8:
        scales = blocks.abs().amax(-1) / 127
        inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
        q = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-128, 127)
        return BlockQuantized(q.to(torch.int8).view(n, k), scales, None, 8, "int8")
    if bits != 4:
        raise ValueError(f"quantize: 4 or 8 bits, not {bits}")
    low, high = blocks.amin(-1), blocks.amax(-1)
    scales = (high - low) / 15
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    q = torch.round((blocks - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 15)
    return BlockQuantized(q.to(torch.int8).view(n, k), scales, low, 4, "int4")
