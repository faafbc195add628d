"""Projections, whole or split for tensor parallelism, that run fast on CPU.

How a product is computed is chosen once, when the weights are loaded (`choose_impl`):

- A quantized weight is packed for the integer kernel (cpu_ops.quant_linear).
- A float weight on CPU goes where layers/linear_dispatch.py says, one path per weight:
  the few-rows kernel (cpu_ops.few_rows_linear: streams the weight at close to the machine's
  bandwidth, made for decode steps) or oneDNN on its blocked layout (the path torch.compile's CPU
  backend takes), each timed on this host at first start, or forced by --linear-backend.
- A weight neither packs (float16; bfloat16 without bfloat16 instructions) stays unpacked:
  few-row products go as W @ Xᵀ, which MKL streams from memory better than X @ Wᵀ; from about a
  hundred rows on the usual orientation is as fast or faster.
- Off CPU: F.linear.

The timings behind the choice on one host: docs/benchmarks.md, "Measured dispatch (issue 25)".

Tensor parallelism: a column-parallel projection keeps this rank's rows of the output, a
row-parallel one its columns of the input, and sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu_features import has_fast_bf16
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import cpu_ops
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.linear_dispatch import FALLBACK, LinearDispatch, LinearImpl, LinearPath
from pagedllm.layers.quantization import BLOCK, BlockQuantized, join_rows

_FEW_ROWS = 96


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """An unpacked weight on CPU: x: [num_rows, in_features] -> [num_rows, out_features]. Unlike
    the packed paths, a row's result may depend on the rows beside it (the two orientations, and
    MKL's own kernels by shape, sum in different orders): it serves only weights neither packed
    path takes (float16; bfloat16 without bfloat16 instructions) and --linear-backend torch."""
    if x.shape[0] > _FEW_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As F.linear, from a weight packed by pack_onednn."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack_onednn(weight: torch.Tensor) -> bool:
    """oneDNN packing pays on CPU in float32, and in bfloat16 where the CPU has bfloat16
    instructions; elsewhere oneDNN's bfloat16 falls back to slow reference kernels."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and has_fast_bf16())


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """The same [out_features, in_features] weight in oneDNN's layout for onednn_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def cpu_paths(weight: torch.Tensor) -> dict[str, LinearPath]:
    """The paths that can take this float weight on CPU, in order of preference: the few-rows
    kernel (one copy of the weight streamed per product), oneDNN, and the unpacked weight."""
    paths = {}
    if cpu_ops.serves_few_rows_linear(weight):
        paths["few_rows"] = LinearPath(cpu_ops.pack_few_rows, cpu_ops.few_rows_linear)
    if can_pack_onednn(weight):
        paths["onednn"] = LinearPath(pack_onednn, onednn_linear)
    paths[FALLBACK] = LinearPath(torch.Tensor.detach, cpu_linear)
    return paths


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor in, refusing one of another shape."""
    if target.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} != expected {tuple(target.shape)}")
    target.copy_(loaded)


Loaded = torch.Tensor | BlockQuantized
"""A checkpoint weight: float, or kept in its quantized blocks (layers/quantization.py)."""


def rows_of(loaded: Loaded, start: int, length: int) -> Loaded:
    return (
        loaded.rows(start, length) if isinstance(loaded, BlockQuantized) else loaded.narrow(0, start, length)
    )


def columns_of(loaded: Loaded, start: int, length: int) -> Loaded:
    return (
        loaded.columns(start, length)
        if isinstance(loaded, BlockQuantized)
        else loaded.narrow(1, start, length)
    )


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


class Linear(DirectCall, nn.Linear):
    """A projection whole on every rank: y = x Wᵀ (+ b)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.impl: LinearImpl = F.linear
        self.quantized_parts: dict[int, BlockQuantized] = {}
        """Quantized checkpoint weights by part (0 unless fused), kept until choose_impl packs them."""
        self.float_parts: set[int] = set()
        """Parts of the weight that loaded as float (a fused one may mix: _place)."""
        self.weight_format = ""
        """How the weight is held once chosen: its quantized format, or empty for float."""
        self.weight_bytes_by_format: dict[str, int] = {}
        """A quantized weight's packed bytes by format (several where runs of parts are packed
        apart: runs_of_equal_bits)."""

    @property
    def quantized(self) -> BlockQuantized | None:
        """The loaded weight in quantized blocks, its parts joined; None if it loaded as float."""
        if not self.quantized_parts:
            return None
        return join_rows([self.quantized_parts[i] for i in sorted(self.quantized_parts)])

    def set_quantized(self, weight: BlockQuantized | None) -> None:
        """Hold `weight` (None: the float weight) from now on; the loader's --quantization policy."""
        self.quantized_parts = {} if weight is None else {0: weight}

    def choose_impl(
        self, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch | None = None
    ) -> None:
        """Pack the weight for the integer kernel (quantized), or for the path `dispatch`
        chooses for a float weight on CPU (default: timed, cached on disk). A weight shared with
        another module (a tied lm_head) is replaced here by its packed copy, so the other module
        keeps its plain tensor. A quantized weight no kernel here takes is dequantized into the
        float weight."""
        parts = [self.quantized_parts[i] for i in sorted(self.quantized_parts)]
        self.quantized_parts = {}
        if parts:
            runs = runs_of_equal_bits(parts)
            n, k = sum(run.shape[0] for run in runs), parts[0].shape[1]
            if device.type == "cpu" and all(cpu_ops.serves_quant_linear(run.bits, n, k) for run in runs):
                packed = [pack_for_quant_linear(run) for run in runs]
                self.weight = nn.Parameter(_joined(packed), requires_grad=False)
                ahead = (dispatch or LinearDispatch()).quant_stream_ahead()
                if len(runs) == 1:
                    self.impl = quant_linear_impl(runs[0].bits, n, k, ahead)
                else:
                    sizes = [(run.bits, run.shape[0], p.numel()) for run, p in zip(runs, packed, strict=True)]
                    self.impl = runs_quant_linear_impl(sizes, k, ahead)
                self.weight_format = "+".join(run.format for run in runs)
                for run, run_packed in zip(runs, packed, strict=True):
                    held = self.weight_bytes_by_format.get(run.format, 0)
                    self.weight_bytes_by_format[run.format] = held + run_packed.numel()
            else:
                dequantized = _joined([run.dequantize(dtype) for run in runs])
                self.weight = nn.Parameter(dequantized.to(device), requires_grad=False)
            for part in parts:
                part.release_file_pages()
            if self.weight_format:
                return
        if device.type == "cpu":
            self._pack_for(dispatch or LinearDispatch(), cpu_paths(self.weight))

    def _pack_for(self, dispatch: LinearDispatch, paths: dict[str, LinearPath]) -> None:
        """Pack the float weight for the path `dispatch` chooses."""
        chosen = paths[dispatch.choose(self.weight, paths)]
        if chosen is not paths[FALLBACK]:  # unpacked, the weight stays the module's own (a tied head's)
            self.weight = nn.Parameter(chosen.pack(self.weight.detach()), requires_grad=False)
        self.impl = chosen.run

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        """Copy a checkpoint tensor into `param` (this rank's part of it, for split layers)."""
        self._place(param, loaded, shard_id, 0)

    def _place(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None, offset: int) -> None:
        """A float part is copied into `param` at row `offset`; a quantized one kept as it is.
        A fused weight whose parts mix the two (a GGUF may keep attn_v in F16 beside Q4_0 q and
        k) is held as float: its quantized parts are dequantized into it, which is exact, where
        quantizing the float parts would round them."""
        if isinstance(loaded, BlockQuantized):
            if param is not self.weight:
                raise ValueError("only a projection's weight may be quantized")
            if loaded.shape[1] != param.shape[1]:
                raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
            if not self.float_parts:
                self.quantized_parts[shard_id or 0] = loaded
                return
            loaded = loaded.dequantize(param.dtype)
        elif param is self.weight:
            self.float_parts.add(shard_id or 0)
            for part_id, part in self.quantized_parts.items():
                rows = param.data.narrow(0, self._part_offset(part_id), part.shape[0])
                copy_weight(rows, part.dequantize(param.dtype))
            self.quantized_parts = {}
        target = param.data if shard_id is None else param.data.narrow(0, offset, loaded.shape[0])
        copy_weight(target, loaded)

    def _part_offset(self, shard_id: int) -> int:
        """The first row of part `shard_id` in the weight."""
        return 0

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
        self._place(param, loaded, shard_id, self._part_offset(shard_id))

    def _part_offset(self, shard_id: int) -> int:
        return sum(self.output_sizes[:shard_id])


class RowParallelLinear(Linear):
    """Split by input columns over the ranks; the ranks' partial outputs are summed (no bias)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup | None) -> None:
        super().__init__(in_features // (tp.world_size if tp is not None else 1), out_features)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        if self.tp is not None and param is self.weight:
            columns = self.in_features
            if isinstance(loaded, BlockQuantized) and columns % BLOCK:
                # a rank's share would cut blocks of 32 inputs (down_proj of intermediate_size
                # 160 over 2 ranks): this rank holds its columns as float, exactly
                loaded = loaded.dequantize(param.dtype)
            loaded = columns_of(loaded, self.tp.rank * columns, columns)
        self._place(param, loaded, shard_id, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.impl(x, self.weight, self.bias)
        return out if self.tp is None else self.tp.all_reduce(out)
