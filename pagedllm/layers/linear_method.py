"""How a projection holds its weight and computes with it: float, or in quantized blocks.

A `Linear` delegates to its LinearMethod (vLLM's LinearMethodBase): it starts float; a part that
loads quantized hands it to BlockQuantizedLinearMethod, and a float part beside quantized ones
hands it back (exact: quantized parts are dequantized into the float weight, where quantizing the
float parts would round them). Once loaded, `prepare` packs the weight for its kernel and returns
the function the layer's forward calls, so forward has no branch on how the weight is held.

- Float: on CPU, the path layers/linear_dispatch.py chooses (layers/float_paths.py); off CPU,
  F.linear.
- Block-quantized (BlockQuantized, every quantized format's one form): on CPU with the integer
  kernel (cpu_ops.quant_linear), its packed blocks, never a float copy; else dequantized once into
  the model's dtype and prepared as float, so the same checkpoint runs everywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.float_paths import cpu_paths
from pagedllm.layers.linear_dispatch import FALLBACK, LinearDispatch, LinearImpl
from pagedllm.layers.quantization import BLOCK, BlockQuantized, join_rows

Loaded = torch.Tensor | BlockQuantized
"""A checkpoint weight: float, or kept in its quantized blocks (layers/quantization.py)."""


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor in, refusing one of another shape."""
    if target.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} != expected {tuple(target.shape)}")
    target.copy_(loaded)


def rows_of(loaded: Loaded, start: int, length: int) -> Loaded:
    """Output rows start .. start + length (a column-parallel rank's share)."""
    return (
        loaded.rows(start, length) if isinstance(loaded, BlockQuantized) else loaded.narrow(0, start, length)
    )


def columns_of(loaded: Loaded, start: int, length: int, dtype: torch.dtype) -> Loaded:
    """Inputs start .. start + length (a row-parallel rank's share). A share that would cut blocks
    of 32 inputs (down_proj of intermediate_size 160 over 2 ranks) is taken as float, exactly."""
    if isinstance(loaded, BlockQuantized) and (start % BLOCK or length % BLOCK):
        loaded = loaded.dequantize(dtype)
    if isinstance(loaded, BlockQuantized):
        return loaded.columns(start, length)
    return loaded.narrow(1, start, length)


class Prepared(NamedTuple):
    """A loaded weight as a method holds it for computing."""

    weight: torch.Tensor
    """The weight as the kernel takes it (packed, or the float weight itself)."""
    impl: LinearImpl
    """(x, weight, bias) -> y: what the layer's forward calls."""
    format: str
    """Its quantized format(s), joined by '+'; empty for float."""
    bytes_by_format: dict[str, int]
    """A quantized weight's packed bytes by format (several where runs of parts are packed apart)."""


class LinearMethod(ABC):
    """How one projection's weight is loaded, held and prepared for computing."""

    @property
    def quantized(self) -> BlockQuantized | None:
        """The weight in quantized blocks, its parts joined; None where it is held as float."""
        return None

    @abstractmethod
    def load(
        self, param: nn.Parameter, weight: torch.Tensor, loaded: Loaded, shard_id: int | None, offset: int
    ) -> LinearMethod:
        """Place a checkpoint part in `param` (the layer's weight or its bias) at row `offset`
        (part `shard_id` of a fused weight); returns the method that holds the weight from now on."""

    @abstractmethod
    def as_float(self, weight: torch.Tensor, dtype: torch.dtype) -> FloatLinearMethod:
        """The weight held as float in `weight` (--quantization none)."""

    @abstractmethod
    def prepare(
        self, weight: torch.Tensor, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch
    ) -> Prepared:
        """The weight packed for the kernel that computes with it on `device` (once, after loading)."""


def _copy_part(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None, offset: int) -> None:
    target = param.data if shard_id is None else param.data.narrow(0, offset, loaded.shape[0])
    copy_weight(target, loaded)


def _check_quantized_fits(param: nn.Parameter, weight: torch.Tensor, loaded: BlockQuantized) -> None:
    if param is not weight:
        raise ValueError("only a projection's weight may be quantized")
    if loaded.shape[1] != param.shape[1]:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")


class FloatLinearMethod(LinearMethod):
    """A float weight, in the layer's own parameter."""

    def __init__(self, float_parts: set[int] | None = None) -> None:
        self.float_parts = float_parts or set()
        """Parts of the weight loaded as float: quantized parts after them are dequantized."""

    def load(
        self, param: nn.Parameter, weight: torch.Tensor, loaded: Loaded, shard_id: int | None, offset: int
    ) -> LinearMethod:
        if isinstance(loaded, BlockQuantized):
            _check_quantized_fits(param, weight, loaded)
            if not self.float_parts:
                return BlockQuantizedLinearMethod().load(param, weight, loaded, shard_id, offset)
            loaded = loaded.dequantize(param.dtype)
        elif param is weight:
            self.float_parts.add(shard_id or 0)
        _copy_part(param, loaded, shard_id, offset)
        return self

    def as_float(self, weight: torch.Tensor, dtype: torch.dtype) -> FloatLinearMethod:
        return self

    def prepare(
        self, weight: torch.Tensor, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch
    ) -> Prepared:
        """On CPU the path `dispatch` chooses (timed, cached on disk); unpacked, the weight stays
        the layer's own parameter (a tied head's shares it with the embedding)."""
        if device.type != "cpu":
            return Prepared(weight, F.linear, "", {})
        paths = cpu_paths(weight)
        chosen = paths[dispatch.choose(weight, paths)]
        packed = weight if chosen is paths[FALLBACK] else chosen.pack(weight.detach())
        return Prepared(packed, chosen.run, "", {})


class BlockQuantizedLinearMethod(LinearMethod):
    """A weight kept in quantized blocks until prepared: packed for the integer kernel."""

    def __init__(self) -> None:
        self.parts: dict[int, tuple[int, BlockQuantized]] = {}
        """Quantized parts by part id (0 unless fused): (first row in the weight, the part)."""

    @classmethod
    def holding(cls, weight: BlockQuantized) -> BlockQuantizedLinearMethod:
        """A method holding the whole `weight` (quantized at load, or a tied head's table)."""
        method = cls()
        method.parts[0] = (0, weight)
        return method

    @property
    def quantized(self) -> BlockQuantized | None:
        return join_rows([part for _, part in self._in_order()]) if self.parts else None

    def _in_order(self) -> list[tuple[int, BlockQuantized]]:
        return [self.parts[i] for i in sorted(self.parts)]

    def load(
        self, param: nn.Parameter, weight: torch.Tensor, loaded: Loaded, shard_id: int | None, offset: int
    ) -> LinearMethod:
        if isinstance(loaded, BlockQuantized):
            _check_quantized_fits(param, weight, loaded)
            self.parts[shard_id or 0] = (offset, loaded)
            return self
        if param is not weight:  # the bias
            _copy_part(param, loaded, shard_id, offset)
            return self
        for first_row, part in self.parts.values():  # a float part: every part held as float
            copy_weight(weight.data.narrow(0, first_row, part.shape[0]), part.dequantize(weight.dtype))
        return FloatLinearMethod(set(self.parts)).load(param, weight, loaded, shard_id, offset)

    def as_float(self, weight: torch.Tensor, dtype: torch.dtype) -> FloatLinearMethod:
        joined = self.quantized
        assert joined is not None
        weight.data.copy_(joined.dequantize(dtype))
        return FloatLinearMethod(set(self.parts))

    def prepare(
        self, weight: torch.Tensor, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch
    ) -> Prepared:
        """Packed for the integer kernel where it takes every run of parts; else dequantized into
        `dtype` and prepared as float. The parts are dropped, and the file's pages under them let
        go, either way."""
        parts = [part for _, part in self._in_order()]
        runs = runs_of_equal_bits(parts)
        n, k = sum(run.shape[0] for run in runs), parts[0].shape[1]
        try:
            if device.type == "cpu" and all(cpu_ops.serves_quant_linear(run.bits, n, k) for run in runs):
                return _packed(runs, n, k, dispatch.quant_stream_ahead())
            dequantized = _joined([run.dequantize(dtype) for run in runs]).to(device)
            return FloatLinearMethod().prepare(
                nn.Parameter(dequantized, requires_grad=False), device, dtype, dispatch
            )
        finally:
            self.parts = {}
            for part in parts:
                part.release_file_pages()


def _packed(runs: list[BlockQuantized], n: int, k: int, stream_ahead: int) -> Prepared:
    """Runs of parts packed one after the other for the integer kernel."""
    packed = [pack_for_quant_linear(run) for run in runs]
    if len(runs) == 1:
        impl = quant_linear_impl(runs[0].bits, n, k, stream_ahead)
    else:
        sizes = [(run.bits, run.shape[0], p.numel()) for run, p in zip(runs, packed, strict=True)]
        impl = runs_quant_linear_impl(sizes, k, stream_ahead)
    bytes_by_format: dict[str, int] = {}
    for run, run_packed in zip(runs, packed, strict=True):
        bytes_by_format[run.format] = bytes_by_format.get(run.format, 0) + run_packed.numel()
    return Prepared(_joined(packed), impl, "+".join(run.format for run in runs), bytes_by_format)


def quant_linear_impl(bits: int, n: int, k: int, stream_ahead: int) -> LinearImpl:
    """The integer kernel over a weight packed by cpu_ops.pack_quant_linear."""

    def impl(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_ops.quant_linear(x, packed, bits, n, k, bias, stream_ahead)

    return impl


def pack_for_quant_linear(weight: BlockQuantized) -> torch.Tensor:
    """The weight packed for the integer kernel: from the file's own bytes where they are still
    encoded in a format the GGUF packer reads, else from codes, scales and mins."""
    encoded = weight.still_encoded
    if encoded is not None and encoded.encoding in cpu_ops.GGUF_PACKED_FORMATS:
        return cpu_ops.pack_gguf_linear(encoded.raw, encoded.encoding, weight.shape[1])
    return cpu_ops.pack_quant_linear(weight.q, weight.scales, weight.mins, weight.bits, weight.per_token)


def runs_of_equal_bits(parts: list[BlockQuantized]) -> list[BlockQuantized]:
    """A fused weight's parts joined where they hold the same bits: joining parts of different
    bits would widen them all to 8 (a Q4_K_M file's Q4_K q and k beside its Q6_K v: 9 bits a
    weight for all three), so each run is packed on its own."""
    runs: list[list[BlockQuantized]] = []
    for part in parts:
        if runs and runs[-1][0].bits == part.bits:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [join_rows(run) for run in runs]


def runs_quant_linear_impl(runs: list[tuple[int, int, int]], k: int, stream_ahead: int) -> LinearImpl:
    """The integer kernel over runs of output rows packed one after the other, (bits, rows,
    packed bytes) each: their outputs side by side."""

    slices, at, row = [], 0, 0  # (bits, rows, first byte, bytes, first output row) per run, once
    for bits, n, size in runs:
        slices.append((bits, n, at, size, row))
        at, row = at + size, row + n

    def impl(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outputs = []
        for bits, n, first, size, first_row in slices:
            part_bias = None if bias is None else bias.narrow(0, first_row, n)
            part = packed.narrow(0, first, size)
            outputs.append(cpu_ops.quant_linear(x, part, bits, n, k, part_bias, stream_ahead))
        return torch.cat(outputs, dim=1)

    return impl


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Parts stacked along dim 0; a lone part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
