"""A GGUF file's weights as they are stored: quantized blocks read into BlockQuantized, not dequantized.

Q8_0, Q4_0, Q4_1, Q4_K and Q5_K read without loss: each is `scale * code + min` per block of 32
(the K-quants' sub-blocks of 32 carry their own scale and min, from 6-bit factors of the
super-block's; Q5_K's 5-bit codes are held as 8-bit ones). Other block formats (Q6_K, whose scales
cover 16 values; Q5_0, Q5_1, Q2_K, Q3_K and the IQ types) are dequantized by the `gguf` package and
quantized again to 8 bits per block of 32: a rounding far below their own, in twice their bytes at
most. F32, F16 and BF16 tensors (norms, sometimes embeddings) come as float32.

A quantized tensor's rows stay encoded (EncodedRows) until used: the CPU kernel packs Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K and Q6_K straight from these bytes (kernels/csrc/gguf_pack_cpu.cpp), and the
readers here spell them out otherwise (the reference path, the embedding's lookups, other devices).

The file is memory-mapped and read tensor by tensor, so no float copy of the model exists at any
time, and nothing is written to disk. llama.cpp stores Llama's Q and K rows permuted for its
rotary layout; that is undone here, by rows, on the codes as on floats. A mixture of experts'
layer stacks its experts in one 3-D tensor per projection (ffn_gate_exps: [experts, rows, columns]
in Hugging Face's order), each expert's rows one run of the bytes: read here as each expert's own
matrix, in its blocks as stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.layers.quantization import BLOCK, BlockQuantized, EncodedRows, quantize
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_convert import hf_tensor_name, hf_tensor_shape, unpermute_rotary_rows
from pagedllm.model.gguf_file import GGUFTensor, read_tensor_directory

Weight = torch.Tensor | BlockQuantized
PERMUTED_ROTARY = ("LlamaForCausalLM", "MixtralForCausalLM")
"""The architectures a "llama" GGUF is read as (model/gguf_metadata.py), whose Q and K rows
llama.cpp's converter permuted for its rotary layout."""


def iter_gguf_weights(gguf_path: Path, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """(Hugging Face tensor name, weight) for every tensor of the file."""
    for tensor in read_tensor_directory(gguf_path):
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config.json (rope_freq_factors)
        name = hf_tensor_name(tensor.name, config.architecture, gguf_path)
        if len(tensor.shape) == 3 and ".experts." in name:  # a layer's experts, stacked
            yield from _experts_apart(tensor, name)
            continue
        weight = read_tensor(tensor)
        if (
            config.architecture == "Gemma3ForCausalLM"
            and isinstance(weight, torch.Tensor)
            and name.endswith("norm.weight")
        ):
            weight = weight - 1.0  # llama.cpp stores Gemma's norms as 1 + weight, the checkpoint's weight
        if isinstance(weight, torch.Tensor):  # (a vector llama.cpp keeps for a one-row matrix)
            weight = weight.reshape(hf_tensor_shape(name, tensor.shape))
        if config.architecture in PERMUTED_ROTARY and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            order = torch.from_numpy(unpermute_rotary_rows(np.arange(weight.shape[0]), heads))
            weight = weight.permute_rows(order) if isinstance(weight, BlockQuantized) else weight[order]
        yield name, weight


def _experts_apart(tensor: GGUFTensor, name: str) -> Iterator[tuple[str, Weight]]:
    """A stacked experts tensor (`name` model.layers.N.mlp.experts.gate_proj.weight, its shape
    checked against the config by tensor_checks.py) as each expert's matrix, named as a
    checkpoint names it (model.layers.N.mlp.experts.E.gate_proj.weight). Each expert's part keeps
    the whole tensor's release: the pages of experts not yet packed are read from the file again."""
    columns, rows, num_experts = tensor.shape
    size = tensor.data.size // num_experts  # bytes an expert
    prefix, _, projection = name.rpartition(".experts.")
    for expert in range(num_experts):
        part = dataclasses.replace(
            tensor, shape=(columns, rows), data=tensor.data[expert * size : (expert + 1) * size]
        )
        yield f"{prefix}.experts.{expert}.{projection}", read_tensor(part)


def read_tensor(tensor: Any) -> Weight:
    """One GGUF tensor: BlockQuantized for a quantized matrix (its rows still encoded, read out
    when used), else float32 [rows, columns]."""
    kind = gguf.GGMLQuantizationType
    shape = tuple(int(d) for d in reversed(tensor.shape))
    qtype = tensor.tensor_type
    if qtype in (kind.F32, kind.F16, kind.BF16) or len(shape) != 2:
        array = gguf.quants.dequantize(tensor.data, qtype).reshape(shape)
        return torch.from_numpy(np.array(array, dtype=np.float32))
    rows, columns = shape
    raw = torch.from_numpy(np.asarray(tensor.data).reshape(rows, -1))
    release = (tensor.release,) if hasattr(tensor, "release") else ()
    reader = _READERS.get(qtype)
    name, bits, _ = held_form(qtype)
    if reader is not None:
        return BlockQuantized.from_encoded(
            EncodedRows(raw, qtype.name, lambda raw: reader(raw.numpy(), raw.shape[0], columns), release),
            columns,
            bits,
            name,
        )
    return BlockQuantized.from_encoded(
        EncodedRows(raw, qtype.name, lambda raw: _widened(raw, qtype, columns), release),
        columns,
        bits,
        name,
    )


def held_form(qtype: gguf.GGMLQuantizationType) -> tuple[str, int, bool]:
    """How a quantized matrix of this format is held once read: the name of its form (the format's,
    or "<format> as 8-bit" where it is widened), the bits of its codes, and whether its blocks keep
    mins apart from the codes (Q4_0's -8 x scale folds into them; pagedllm/planner.py sizes by this)."""
    bits_and_mins = _HELD_BITS.get(qtype)
    if bits_and_mins is None:
        return f"{qtype.name} as 8-bit", 8, False
    return qtype.name, *bits_and_mins


def _widened(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, columns: int) -> BlockQuantized:
    """A format no reader here takes, dequantized by `gguf` and quantized again to 8 bits."""
    array = gguf.quants.dequantize(raw.numpy(), qtype).reshape(raw.shape[0], columns)
    widened = quantize(torch.from_numpy(np.asarray(array, dtype=np.float32)), 8)
    return BlockQuantized(widened.q, widened.scales, None, 8, f"{qtype.name} as 8-bit")


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (the last axis: 2 bytes) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low halves first, then the high halves (Q4_0's, Q4_1's order);
    in torch, whose element-wise ops run on every core."""
    packed = torch.from_numpy(np.ascontiguousarray(raw))
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).numpy()


def _block_quantized(
    codes: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray | None,
    bits: int,
    name: str,
    rows: int,
    columns: int,
) -> BlockQuantized:
    return BlockQuantized(
        torch.from_numpy(codes.astype(np.int8).reshape(rows, columns)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, columns // BLOCK)),
        None
        if mins is None
        else torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, -1)),
        bits,
        name,
    )


def _q8_0(blocks: np.ndarray, rows: int, columns: int) -> BlockQuantized:
    b = blocks.reshape(rows, columns // 32, 34)
    return _block_quantized(b[..., 2:].view(np.int8), _f16(b[..., :2]), None, 8, "Q8_0", rows, columns)


def _q4_0(blocks: np.ndarray, rows: int, columns: int) -> BlockQuantized:
    b = blocks.reshape(rows, columns // 32, 18)
    d = _f16(b[..., :2])
    return _block_quantized(_nibbles(b[..., 2:]), d, -8 * d, 4, "Q4_0", rows, columns)


def _q4_1(blocks: np.ndarray, rows: int, columns: int) -> BlockQuantized:
    b = blocks.reshape(rows, columns // 32, 20)
    return _block_quantized(
        _nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]), 4, "Q4_1", rows, columns
    )


def _q4_k(blocks: np.ndarray, rows: int, columns: int) -> BlockQuantized:
    """Super-blocks of 256: d, dmin (float16), 12 bytes of 6-bit factors, 128 bytes of codes, in 4
    runs of 32 bytes whose low halves are one sub-block of 32 and high halves the next."""
    b = blocks.reshape(-1, 144)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    factors, minimums = _k_scale_min(b[:, 4:16])
    runs = b[:, 16:].reshape(-1, 4, 1, 32)
    codes = np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(-1, 8, 32)
    scales = d * factors.astype(np.float32)
    mins = -(dmin * minimums.astype(np.float32))
    return _block_quantized(codes, scales, mins, 4, "Q4_K", rows, columns)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' 6-bit scale and min factors from a K-quant's 12 bytes (llama.cpp's
    get_scale_min_k4): bytes 0-3 scales' low 6 bits, 4-7 mins', 8-11 both's low 4 bits beside the
    top 2 of bytes 0-7."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    factors = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimums = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return factors, minimums


def _q5_k(blocks: np.ndarray, rows: int, columns: int) -> BlockQuantized:
    """Q4_K's super-block with 32 bytes of fifth bits (bit j of byte i: code i of sub-block j)
    before the codes: codes 0..31, held as 8-bit ones without loss."""
    b = blocks.reshape(-1, 176)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    factors, minimums = _k_scale_min(b[:, 4:16])
    fifth = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    runs = b[:, 48:].reshape(-1, 4, 1, 32)
    low = np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(-1, 8, 32)
    scales = d * factors.astype(np.float32)
    mins = -(dmin * minimums.astype(np.float32))
    return _block_quantized(low | (fifth << 4), scales, mins, 8, "Q5_K", rows, columns)


_HELD_BITS = {  # the formats read without loss: their codes' bits as held, and whether mins are kept
    gguf.GGMLQuantizationType.Q8_0: (8, False),
    gguf.GGMLQuantizationType.Q4_0: (4, False),
    gguf.GGMLQuantizationType.Q4_1: (4, True),
    gguf.GGMLQuantizationType.Q4_K: (4, True),
    gguf.GGMLQuantizationType.Q5_K: (8, True),
}
_READERS = {
    gguf.GGMLQuantizationType.Q8_0: _q8_0,
    gguf.GGMLQuantizationType.Q4_0: _q4_0,
    gguf.GGMLQuantizationType.Q4_1: _q4_1,
    gguf.GGMLQuantizationType.Q4_K: _q4_k,
    gguf.GGMLQuantizationType.Q5_K: _q5_k,
}
