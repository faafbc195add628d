"""Projections, whole or split for tensor parallelism, that run fast on CPU.

A projection delegates how it holds and computes with its weight to its LinearMethod
(layers/linear_method.py): float, or in quantized blocks for the integer kernel. Loading
hands each checkpoint part to the method, which may hand the weight to another (a part that loads
quantized, a float part beside quantized ones); `choose_impl` has the method pack the weight once,
and forward calls the function it chose. Nothing here branches on how the weight is held.

Tensor parallelism: a column-parallel projection keeps this rank's rows of the output, a
row-parallel one its columns of the input, and sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.float_paths import cpu_linear, cpu_paths, onednn_linear, pack_onednn
from pagedllm.layers.linear_dispatch import LinearDispatch, LinearImpl
from pagedllm.layers.linear_method import (
    BlockQuantizedLinearMethod,
    FloatLinearMethod,
    LinearMethod,
    Loaded,
    columns_of,
    copy_weight,
    rows_of,
)
from pagedllm.layers.quantization import BlockQuantized

__all__ = [  # the float CPU paths and loading helpers, where callers have always found them
    "Linear",
    "Loaded",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "copy_weight",
    "cpu_linear",
    "cpu_paths",
    "onednn_linear",
    "pack_onednn",
    "rows_of",
]


class Linear(DirectCall, nn.Linear):
    """A projection whole on every rank: y = x Wᵀ (+ b)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = FloatLinearMethod()
        """How the weight is held: float until a part loads quantized."""
        self.impl: LinearImpl = F.linear
        self.weight_format = ""
        """How the weight is held once chosen: its quantized format, or empty for float."""
        self.weight_bytes_by_format: dict[str, int] = {}
        """A quantized weight's packed bytes by format (several where runs of parts are packed
        apart: runs_of_equal_bits)."""

    @property
    def quantized(self) -> BlockQuantized | None:
        """The loaded weight in quantized blocks, its parts joined; None if it is held as float."""
        return self.method.quantized

    def set_quantized(self, weight: BlockQuantized) -> None:
        """Hold `weight` from now on (quantized at load by --quantization, or a tied head's table)."""
        self.method = BlockQuantizedLinearMethod.holding(weight)

    def dequantize(self, dtype: torch.dtype) -> None:
        """Hold the weight as float in `dtype` (--quantization none)."""
        self.method = self.method.as_float(self.weight, dtype)

    def choose_impl(
        self, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch | None = None
    ) -> None:
        """Have the method pack the weight for its kernel on `device` (a float weight on CPU: the
        path `dispatch` chooses, default timed and cached on disk). A weight shared with another
        module (a tied lm_head) is replaced here by its packed copy, so the other module keeps its
        plain tensor."""
        prepared = self.method.prepare(self.weight, device, dtype, dispatch or LinearDispatch())
        if prepared.weight is not self.weight:
            self.weight = nn.Parameter(prepared.weight, requires_grad=False)
        self.impl = prepared.impl
        self.weight_format = prepared.format
        self.weight_bytes_by_format = dict(prepared.bytes_by_format)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        """Copy a checkpoint tensor into `param` (this rank's part of it, for split layers)."""
        self._place(param, loaded, shard_id, 0)

    def _place(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None, offset: int) -> None:
        """Hand part `shard_id` (its first row `offset`) to the method."""
        self.method = self.method.load(param, self.weight, loaded, shard_id, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        return self.impl(x, self.weight, self.bias)


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input fused into one (q/k/v, gate/up), each split by
    output rows over the ranks: this rank holds its rows of each, one after the other."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup | None) -> None:
        tp_size = tp.world_size if tp is not None else 1
        super().__init__(in_features, sum(output_sizes) // tp_size, bias=bias)
        self.tp = tp
        self.output_sizes = [size // tp_size for size in output_sizes]  # this rank's

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        """`loaded`: the whole checkpoint tensor of projection `shard_id` (its index in output_sizes)."""
        assert shard_id is not None
        size = self.output_sizes[shard_id]
        if self.tp is not None:
            loaded = rows_of(loaded, self.tp.rank * size, size)
        if loaded.shape[0] != size:
            raise ValueError(f"shape {tuple(loaded.shape)}: expected {size} rows")
        self._place(param, loaded, shard_id, sum(self.output_sizes[:shard_id]))


class RowParallelLinear(Linear):
    """Split by input columns over the ranks; the ranks' partial outputs are summed (no bias),
    unless `reduce_results` is False: then the caller sums them, once for several partial outputs
    (a mixture of experts' shared expert beside its routed ones)."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPGroup | None, reduce_results: bool = True
    ) -> None:
        super().__init__(in_features // (tp.world_size if tp is not None else 1), out_features)
        self.tp = tp
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        if self.tp is not None and param is self.weight:
            columns = self.in_features
            loaded = columns_of(loaded, self.tp.rank * columns, columns, param.dtype)
        self._place(param, loaded, shard_id, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.impl(x, self.weight, self.bias)
        return out if self.tp is None or not self.reduce_results else self.tp.all_reduce(out)
