"""The projections a LoRA adapter may change, by the name a checkpoint gives them.

An adapter names projections as the Hugging Face model does (`model.layers.3.self_attn.q_proj`);
pagedllm fuses some of them (q, k and v in one `qkv_proj`, gate and up in `gate_up_proj`), so each
name maps to a module and a part of its output rows. Sizes come from the config alone: the front
end checks an adapter against them before any request runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model.config import ModelConfig

ATTENTION_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
ATTENTION_OUTPUT = {"o_proj": ("o_proj", 0)}
MLP_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
SUPPORTED = (*ATTENTION_PARTS, *ATTENTION_OUTPUT, *MLP_PARTS)
"""The checkpoint projections an adapter may target (vLLM's dense set for these models)."""


@dataclass(frozen=True)
class LoRATarget:
    """One checkpoint projection: the module of ours that computes it, its part there (rows
    part_offset.. of the fused output), and its sizes."""

    module: str
    """Our module's path in the model, e.g. layers.3.self_attn.qkv_proj."""
    part: int
    in_features: int
    out_features: int


def lora_targets(config: ModelConfig) -> dict[str, LoRATarget]:
    """Every projection an adapter may change, by its checkpoint name without the `model.`
    prefix (layers.3.self_attn.q_proj). A layer with experts has no dense MLP to target."""
    hidden, q, kv = config.hidden_size, config.q_size, config.kv_size
    sizes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, config.intermediate_size),
        "up_proj": (hidden, config.intermediate_size),
        "down_proj": (config.intermediate_size, hidden),
    }
    targets = {}
    for index in range(config.num_hidden_layers):
        parts = {**ATTENTION_PARTS, **ATTENTION_OUTPUT}
        if not config.is_sparse_layer(index):
            parts.update(MLP_PARTS)
        for name, (module, part) in parts.items():
            block = "self_attn" if name in ATTENTION_PARTS or name in ATTENTION_OUTPUT else "mlp"
            in_features, out_features = sizes[name]
            targets[f"layers.{index}.{block}.{name}"] = LoRATarget(
                f"layers.{index}.{block}.{module}", part, in_features, out_features
            )
    return targets


def fused_parts(module: str) -> tuple[str, ...]:
    """The checkpoint projections fused in our module named `module` (its last path part), in
    the order of its output rows."""
    name = module.rsplit(".", 1)[-1]
    groups: dict[str, list[str]] = {}
    for part_name, (fused, _) in {**ATTENTION_PARTS, **ATTENTION_OUTPUT, **MLP_PARTS}.items():
        groups.setdefault(fused, []).append(part_name)
    return tuple(groups[name])
