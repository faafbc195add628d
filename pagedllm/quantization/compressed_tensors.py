"""compressed-tensors checkpoints (llm-compressor's): integer weights, W8A8's int8 and W4A16's packed int4."""

from __future__ import annotations

from typing import Any

from pagedllm.model.checkpoint_quant import CheckpointQuantization, Scheme, group_size
from pagedllm.quantization.base import HeldByCheckpoint

_LAYOUTS = {"pack-quantized": "ct-packed", "int-quantized": "ct-int", "naive-quantized": "ct-int"}
"""compressed-tensors' weight formats read here -> Scheme.layout."""


class CompressedTensors(HeldByCheckpoint):
    name = "compressed-tensors"
    held_as = "compressed-tensors checkpoint"

    @classmethod
    def read(cls, config: dict[str, Any]) -> CheckpointQuantization:
        default_format = config.get("format", "int-quantized")
        groups = []
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or default_format
            scheme = _scheme(name, group, fmt)
            groups.append((tuple(group.get("targets") or ("Linear",)), scheme))
        if not groups:
            raise ValueError("quantization_config (compressed-tensors): no config_groups")
        return CheckpointQuantization("compressed-tensors", tuple(groups), tuple(config.get("ignore") or ()))


def _scheme(name: str, group: dict[str, Any], fmt: str) -> Scheme:
    """One config group's weights (and, for W8A8, its activations) -> Scheme."""
    weights = group.get("weights") or {}
    layout = _LAYOUTS.get(fmt)
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    if (
        layout is None
        or kind != "int"
        or bits not in (4, 8)
        or strategy not in ("tensor", "channel", "group")
    ):
        raise ValueError(
            f"quantization_config (compressed-tensors) {name}: integer weights of 4 or 8 bits, "
            f"pack-quantized or int-quantized, per tensor, channel or group, are read; not "
            f"format={fmt!r}, type={kind!r}, num_bits={bits!r}, strategy={strategy!r}"
        )
    group_inputs = group_size(weights.get("group_size"), "compressed-tensors") if strategy == "group" else -1
    act_order = weights.get("actorder") not in (None, False, "static")
    symmetric = bool(weights.get("symmetric", True))
    activations = group.get("input_activations") or {}
    per_token = (
        activations.get("num_bits") == 8
        and activations.get("type", "int") == "int"
        and activations.get("strategy") == "token"
        and bool(activations.get("dynamic"))
        and bits == 8
        and strategy in ("tensor", "channel")
        and symmetric
    )
    return Scheme(layout, bits, group_inputs, symmetric, act_order, per_token)
