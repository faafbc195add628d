"""The models pagedllm runs: config.json's architecture -> the class that runs it, in one table.

A new architecture is one row here (and its model file). model/config.py reads the names to accept
a config; the loader asks `model_class` for the class. Rows name a module rather than import it, so
model/config.py, which every model file imports, can read this table without importing them (vLLM's
registry does the same, for the same reason).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.model.llama import LlamaForCausalLM


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
    llama)."""


MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "llama", "llama"),
    "MistralForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "qwen2", "qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe"),
    "Gemma3ForCausalLM": ModelEntry("gemma3", "Gemma3ForCausalLM", "gemma3", "gemma3"),
}
"""config.json's architecture -> its model. Every model is the Llama layout or a subclass of it."""

LANGUAGE_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Image-and-text checkpoints served as their language model alone (text in, text out): config.json's
text_config, the weights under language_model; the vision tower is not loaded."""


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class that runs `architecture` (a MODELS key: ModelConfig accepts no other)."""
    entry = MODELS[architecture]
    cls: type[LlamaForCausalLM] = getattr(
        importlib.import_module(f"pagedllm.model.{entry.module}"), entry.class_name
    )
    return cls
