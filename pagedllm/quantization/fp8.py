"""FP8 checkpoints (quant_method "fp8": Qwen's and DeepSeek's *-FP8 releases, AutoFP8's per-tensor
ones), read into 8-bit blocks of 32: pagedllm has no fp8 matrix product on CPU.

quantization_config, as vLLM's Fp8Config reads it:
- fmt: e4m3 (float8_e4m3fn weights; what a config without fmt means). e5m2 is refused.
- weight_block_size [rows, inputs]: each projection's `weight` [N, K] in float8 with
  `weight_scale_inv` float32 [ceil(N / rows), ceil(K / inputs)], W = weight x scale per block
  (ragged at the edges). Blocks take activation_scheme dynamic only (vLLM's rule).
- without weight_block_size: one scale per projection (`weight_scale`; transformers writes
  `weight_scale_inv`), activation_scheme dynamic or static. A static scheme's `input_scale`s are
  read and dropped, as vLLM accepts them and as compressed-tensors' are here: the integer kernel
  quantizes activations per block of 32 as it computes.
- ignored_layers / modules_to_not_convert: projections stored in bfloat16, read as every float
  tensor is (a projection is fp8 where its weight is). So are embeddings, norms and the LM head.

Each fp8 projection is dequantized in float32 and quantized again to 8 bits per block of 32 inputs
(layers/quantization.py's quantize, as GGUF's unread formats are widened), held as "fp8 as 8-bit":
a rounding on top of fp8's, for the integer kernel. Until first used its rows stay as the file's
bytes (one a weight) with their scales. --quantization none reads the file's values themselves
into float, the reference a quantized run is measured by; so is a projection whose K is not a
whole number of blocks of 32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.linear_method import Loaded
from pagedllm.layers.quantization import BLOCK, BlockQuantized, EncodedRows, quantize
from pagedllm.model.checkpoint_quant import CheckpointQuantization, Scheme
from pagedllm.model.config import ModelConfig
from pagedllm.quantization.base import HeldByCheckpoint, iter_safetensors

logger = logging.getLogger(__name__)

FORMAT = "fp8 as 8-bit"
"""The name the start-up line and `pagedllm plan` give the weights."""

_SCALES = ("weight_scale_inv", "weight_scale")
_DROPPED = ("input_scale", "activation_scale", "k_scale", "v_scale")
"""Static activation scales (unused: see above) and KV cache scales (--kv-cache-dtype has its own)."""


@dataclass(frozen=True)
class FP8Quantization(CheckpointQuantization):
    """An fp8 quantization_config, read: every projection held as 8-bit blocks of 32."""

    block_size: tuple[int, int] | None = None
    """weight_block_size (rows, inputs) a scale covers; None: one scale per projection."""

    def format(self, scheme: Scheme) -> str:
        return FORMAT


class FP8(HeldByCheckpoint):
    name = "fp8"
    held_as = "fp8 checkpoint"

    @classmethod
    def read(cls, config: dict[str, Any]) -> FP8Quantization:
        fmt = str(config.get("fmt", "e4m3")).lower()
        activations = str(config.get("activation_scheme", "dynamic")).lower()
        block = config.get("weight_block_size")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config (fp8): fmt 'e4m3' (float8_e4m3fn) is read, not {fmt!r}")
        if activations not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config (fp8): activation_scheme 'dynamic' or 'static', not {activations!r}"
            )
        if block is not None:
            if not (
                isinstance(block, list | tuple)
                and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
            ):
                raise ValueError(
                    f"quantization_config (fp8): weight_block_size is two positive integers "
                    f"[rows, inputs], not {block!r}"
                )
            if activations != "dynamic":
                raise ValueError(
                    "quantization_config (fp8): weight_block_size takes activation_scheme 'dynamic' "
                    f"(as vLLM's), not {activations!r}"
                )
        scheme = Scheme("fp8", 8, BLOCK, symmetric=True)  # as held: 8-bit blocks of 32, no mins
        return FP8Quantization("fp8", ((("Linear",), scheme),), block_size=tuple(block) if block else None)

    def weights(
        self, files: list[Path], config: ModelConfig, dequantize: bool = False
    ) -> Iterable[tuple[str, Loaded]]:
        assert isinstance(self.checkpoint, FP8Quantization)
        return iter_fp8_weights(iter_safetensors(files), self.checkpoint.block_size, dequantize)


def iter_fp8_weights(
    tensors: Iterable[tuple[str, torch.Tensor]], block_size: tuple[int, int] | None, dequantize: bool = False
) -> Iterator[tuple[str, Loaded]]:
    """The checkpoint's tensors with each fp8 projection's weight and scale read into one
    `MODULE.weight`: 8-bit blocks of 32, or float32 (`dequantize`, or K not whole blocks of 32).
    Other tensors pass through; a weight without its scale (or a scale without its weight) is a
    ValueError naming the module."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    held_as_float = 0
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        if leaf == "weight" and tensor.dtype == torch.float8_e5m2:
            raise ValueError(f"fp8 checkpoint: {name} is float8_e5m2; float8_e4m3fn is read")
        if not (leaf in _SCALES or (leaf == "weight" and tensor.dtype == torch.float8_e4m3fn)):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts["scale" if leaf in _SCALES else "weight"] = tensor
        if len(parts) == 2:
            del pending[module]
            weight = _read_weight(module, parts["weight"], parts["scale"], block_size, dequantize)
            if not (dequantize or isinstance(weight, BlockQuantized)):
                held_as_float += 1
            yield f"{module}.weight", weight
    if held_as_float:
        logger.info(
            "%d fp8 projections dequantized to float at load: inputs not whole blocks of %d",
            held_as_float,
            BLOCK,
        )
    if pending:
        module, parts = next(iter(pending.items()))
        lacks = "its weight_scale_inv (or weight_scale)" if "weight" in parts else "its float8 weight"
        raise ValueError(f"fp8 checkpoint: {module} lacks {lacks}")


def _read_weight(
    module: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | None,
    dequantize: bool,
) -> Loaded:
    """One projection's float8 weight [N, K] and its scales -> BlockQuantized, rows kept as the
    file's bytes with each row's scales beside them until used; or float32."""
    n, k = weight.shape
    if scale.numel() == 1:
        rows, inputs = n, k
    elif block_size is None:
        raise ValueError(
            f"fp8 checkpoint: {module}: scales {list(scale.shape)} without weight_block_size in "
            "quantization_config (one scale per projection is read without it)"
        )
    else:
        rows, inputs = block_size
    blocks = (-(-n // rows), -(-k // inputs))
    scale = scale.float().reshape(blocks) if scale.numel() == 1 else scale.float()
    if scale.shape != blocks:
        raise ValueError(
            f"fp8 checkpoint: {module}: weight [{n}, {k}] in blocks of [{rows}, {inputs}] takes scales "
            f"{list(blocks)}, not {list(scale.shape)}"
        )
    row_scales = scale.repeat_interleave(rows, dim=0)[:n].contiguous()  # [N, blocks of inputs]
    raw = torch.cat([weight.view(torch.uint8), row_scales.view(torch.uint8)], dim=1)
    if dequantize or k % BLOCK:
        return _values(raw, k, inputs)
    encoded = EncodedRows(
        raw, f"fp8 e4m3, blocks of {inputs} inputs", functools.partial(_decode, k=k, inputs=inputs)
    )
    return BlockQuantized.from_encoded(encoded, k, 8, FORMAT)


def _values(raw: torch.Tensor, k: int, inputs: int) -> torch.Tensor:
    """Rows of float8 bytes and float32 scales (one per `inputs` of the row) -> W, float32 [rows, K]."""
    weight = raw[:, :k].contiguous().view(torch.float8_e4m3fn).float()
    scales = raw[:, k:].contiguous().view(torch.float32)
    return weight * scales.repeat_interleave(inputs, dim=1)[:, :k]


def _decode(raw: torch.Tensor, k: int, inputs: int) -> BlockQuantized:
    """The rows' values quantized to 8 bits per block of 32 inputs."""
    held = quantize(_values(raw, k, inputs), 8)
    return BlockQuantized(held.q, held.scales, None, 8, FORMAT)
