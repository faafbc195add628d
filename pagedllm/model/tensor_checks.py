"""A config checked against the tensors its file holds, before any weight is allocated.

A config's sizes are only claims: a config.json of 1,024 layers beside safetensors of 2, or a
GGUF whose block_count says 2e8, would have the engine build (and `plan` size) a model the file
cannot fill. So the layers the tensors name must be the config's layers, exactly, and every
tensor of a known kind must have the shape the config gives it (the embedding's rows are the
vocabulary, its columns the hidden size). Read from headers alone: a GGUF's tensor directory
(model/gguf_file.py, which has checked each tensor's bytes lie inside the file), the JSON header
of each safetensors file, or, where the weights are not here, the index's names.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import ModelLoadError, read_json
from pagedllm.model.registry import checkpoint_tensor_name

MAX_SAFETENSORS_HEADER_BYTES = 100 * 2**20
"""The safetensors format's own limit on its JSON header."""
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip
"""The safetensors format's dtypes, in bits per element (F4 and F6 pack several to a byte)."""
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")


def expected_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(whole-model tensor -> shape, per-layer tensor suffix -> shape), Hugging Face names and
    order ([out, in]) for weights; a bias is its weight's first dimension."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, d = config.q_size, config.kv_size, config.head_dim
    model = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,),
        "post_feedforward_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if config.num_experts is not None and config.moe_intermediate_size is not None:
        e, m = config.num_experts, config.moe_intermediate_size
        layer |= {
            "mlp.gate.weight": (e, h),
            "mlp.experts.*.gate_proj.weight": (m, h),  # each expert's (experts.E.*: E in place of *)
            "mlp.experts.*.up_proj.weight": (m, h),
            "mlp.experts.*.down_proj.weight": (h, m),
            "mlp.experts.gate_proj.weight": (e, m, h),  # a GGUF's, stacked (ffn_gate_exps, ...)
            "mlp.experts.up_proj.weight": (e, m, h),
            "mlp.experts.down_proj.weight": (e, h, m),
            "mlp.experts.gate_up_proj": (e, 2 * m, h),  # transformers' own stacked layout
            "mlp.experts.down_proj": (e, h, m),
        }
    if config.shared_expert_intermediate_size is not None:
        s = config.shared_expert_intermediate_size
        layer |= {
            "mlp.shared_expert.gate_proj.weight": (s, h),
            "mlp.shared_expert.up_proj.weight": (s, h),
            "mlp.shared_expert.down_proj.weight": (h, s),
            "mlp.shared_expert_gate.weight": (1, h),
        }
    return model, layer


Listed = tuple[str, "tuple[int, ...] | None", str]
"""A file's tensor: its Hugging Face name, its shape [out, in] (None: unknown), its own name."""


def check_tensors_against_config(tensors: Iterable[Listed], config: ModelConfig, source: str) -> None:
    """The layers `tensors` (a file's language model) name must be exactly the config's; known
    tensors must have the config's shapes; the token embedding must be there."""
    model_shapes, layer_shapes = expected_shapes(config)
    layers: set[int] = set()
    has_embedding = False
    for name, shape, own_name in tensors:
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1))
            if index >= config.num_hidden_layers:
                raise ModelLoadError(
                    f"{source}: tensor {own_name!r} is of layer {index}, but the config has "
                    f"{config.num_hidden_layers} layers (0 to {config.num_hidden_layers - 1})"
                )
            layers.add(index)
            expected = layer_shapes.get(_expert_pattern(name[match.end() :], config, source, own_name))
        else:
            expected = model_shapes.get(name)
            has_embedding = has_embedding or name == "model.embed_tokens.weight"
        if expected is not None and shape is not None and tuple(shape) != expected:
            experts = (
                ""
                if config.num_experts is None
                else f", {config.num_experts} experts of {config.moe_intermediate_size}"
            )
            raise ModelLoadError(
                f"{source}: tensor {own_name!r} has shape {list(shape)}, but the config's sizes make it "
                f"{list(expected)} (vocab_size {config.vocab_size}, hidden_size {config.hidden_size}, "
                f"intermediate_size {config.intermediate_size}, heads {config.num_attention_heads}/"
                f"{config.num_key_value_heads} of {config.head_dim}{experts})"
            )
    missing = sorted(set(range(config.num_hidden_layers)) - layers)
    if missing:
        raise ModelLoadError(
            f"{source}: the config has {config.num_hidden_layers} layers but the file holds no tensor "
            f"of {len(missing)} of them (first: layer {missing[0]})"
        )
    if not has_embedding:
        raise ModelLoadError(f"{source}: the file holds no token embedding tensor")


def _expert_pattern(suffix: str, config: ModelConfig, source: str, own_name: str) -> str:
    """A layer tensor's name after `model.layers.N.`, an expert's index in it checked against the
    config's experts and replaced by * (expected_shapes' key for every expert)."""
    match = _EXPERT.match(suffix)
    if match is None:
        return suffix
    index = int(match.group(1))
    if config.num_experts is None or index >= config.num_experts:
        raise ModelLoadError(
            f"{source}: tensor {own_name!r} is of expert {index}, but the config has "
            f"{config.num_experts or 'no'} experts a layer"
        )
    return f"mlp.experts.*.{suffix[match.end() :]}"


def check_checkpoint_tensors(folder: Path, config: ModelConfig) -> None:
    """An HF folder's tensors against its config: from the safetensors headers where the weights
    are here, else from model.safetensors.index.json's names; nothing to check without either
    (a hub model planned from its config alone)."""
    files = sorted(folder.glob("*.safetensors"))
    named: list[Listed] = []
    if files:
        for file in files:
            for name, shape in read_safetensors_header(file).items():
                hf_name = checkpoint_tensor_name(name, config.architecture)
                if hf_name is not None:
                    named.append((hf_name, shape, name))
        check_tensors_against_config(named, config, str(folder))
        return
    index = folder / "model.safetensors.index.json"
    if index.exists():
        contents = read_json(index)
        weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map object of tensor names")
        listed = [(checkpoint_tensor_name(name, config.architecture), None, name) for name in weight_map]
        check_tensors_against_config(
            [(hf_name, None, name) for hf_name, _, name in listed if hf_name is not None], config, str(index)
        )


def read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file's tensors and shapes, from its header alone; ModelLoadError where the
    header is damaged or a tensor's bytes lie outside the file."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(f"{path}: {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_SAFETENSORS_HEADER_BYTES, size - 8):
            raise ModelLoadError(
                f"{path}: header length {length:,} at offset 0 is past the file's {size:,} bytes "
                f"(or the format's {MAX_SAFETENSORS_HEADER_BYTES:,}): truncated or not safetensors"
            )
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ModelLoadError(f"{path}: the header at offset 8 is not JSON ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the header at offset 8 is not a JSON object")
    data_size = size - 8 - length
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shapes[name] = _checked_entry(path, name, entry, data_size)
    return shapes


def _checked_entry(path: Path, name: str, entry: Any, data_size: int) -> tuple[int, ...]:
    def fail(problem: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: tensor {name[:100]!r}: {problem}")

    if not isinstance(entry, dict):
        raise fail("its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise fail(f"unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 8:
        raise fail("its shape is not a list of up to 8 non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise fail(f"its data_offsets are not a range inside the file's {data_size:,} data bytes")
    bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    expected = bits // 8
    if bits % 8 or offsets[1] - offsets[0] != expected:
        raise fail(f"{offsets[1] - offsets[0]:,} bytes for {dtype} {shape} ({expected:,} expected)")
    return tuple(shape)
