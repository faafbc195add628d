"""The models pagedllm runs: config.json's architecture -> the class that runs it, in one table.

A new architecture is one row here (and its model file). model/config_reader.py reads the names to
accept a config; model_loader.py's `model_class` imports the class a row names. Rows name a module rather
than import it, so this table is data alone: the config's reader and checkers read it without
importing a model (vLLM's registry does the same, for the same reason). Image-and-text checkpoints
served as their language model are here too, with the rule that names their tensors as the text
model's (`language_model_name`), and a row may rename a checkpoint's tensors to the names its model
loads (`checkpoint_tensor_name`: released Mixtral checkpoints' block_sparse_moe.experts.E.w1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    """Where an architecture's model class lives."""

    module: str
    """Its module under pagedllm.model."""
    class_name: str
    model_type: str
    """config.json's model_type for it."""
    gguf_architecture: str | None = None
    """A GGUF's general.architecture read as this architecture (None: none is; a Mistral GGUF says
    llama, and so does a Mixtral one, whose experts tell it apart: gguf_metadata.EXPERTS_ARCHITECTURES)."""
    renames: tuple[tuple[str, str], ...] = ()
    """(old, new) parts of a checkpoint's tensor names, replaced in order: the names its released
    checkpoints give tensors that its model, as transformers 5 does, names otherwise."""


_MIXTRAL_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)
"""Mixtral-8x7B's files: block_sparse_moe.gate (the router) and block_sparse_moe.experts.E.w1 / w3 /
w2 (gate, up, down), which transformers 5's conversion mapping loads as mlp.gate and mlp.experts."""


MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "llama", "llama"),
    "MistralForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "qwen2", "qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3"),
    "Qwen2MoeForCausalLM": ModelEntry("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", "qwen2moe"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe"),
    "MixtralForCausalLM": ModelEntry("mixtral", "MixtralForCausalLM", "mixtral", renames=_MIXTRAL_RENAMES),
    "Gemma3ForCausalLM": ModelEntry("gemma3", "Gemma3ForCausalLM", "gemma3", "gemma3"),
}
"""config.json's architecture -> its model. Every model is the Llama layout or a subclass of it."""

LANGUAGE_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Image-and-text checkpoints served as their language model alone (text in, text out): config.json's
text_config, the weights under language_model; the vision tower is not loaded."""


_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")
_LANGUAGE_MODEL_PREFIXES = ("language_model.", "model.language_model.")


def language_model_name(checkpoint_name: str) -> str | None:
    """An image-and-text checkpoint's language-model tensor under its text model's name (Gemma 3:
    language_model.model.X, or model.language_model.X as transformers 5 names it, -> model.X);
    None for its vision tower and projector. Other checkpoints' names pass as they are."""
    if checkpoint_name.removeprefix("model.").startswith(_VISION_PARTS):
        return None
    for prefix in _LANGUAGE_MODEL_PREFIXES:
        if checkpoint_name.startswith(prefix):
            rest = checkpoint_name.removeprefix(prefix)
            return rest if rest.startswith(("model.", "lm_head.")) else f"model.{rest}"
    return checkpoint_name


def checkpoint_tensor_name(checkpoint_name: str, architecture: str) -> str | None:
    """A checkpoint's tensor under the Hugging Face name the loader maps for `architecture` (a
    MODELS key): language_model_name's, then the row's renames; None where it is not loaded."""
    name = language_model_name(checkpoint_name)
    if name is None:
        return None
    for old, new in MODELS[architecture].renames:
        name = name.replace(old, new)
    return name
