"""Where a model and its tokenizer live: `--model` (a folder, a GGUF file, a hub id or None for
the embedded default) and `--tokenizer` resolved once, before anything is loaded.

A front end resolves them: it hands the core a ModelSource (the core loads the weights, and needs
no tokenizer) and loads the tokenizer itself, from `tokenizer_folder`, before the core starts, so
a broken tokenizer fails in a second, not after the weights have loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.model.config import ModelConfig
from pagedllm.model.config_reader import gguf_source, model_config_from_folder
from pagedllm.model.errors import loading, loading_tokenizer
from pagedllm.model.locate import model_display_name, resolve_model_folder, resolve_tokenizer_folder
from pagedllm.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: plain paths and the parsed config, so it crosses to a core as it is."""

    name: str
    """The display name, e.g. SmolLM2-135M-Instruct (a hub id as given)."""
    folder: Path
    model_config: ModelConfig
    tokenizer_folder: Path
    """--tokenizer's folder, else the model's."""

    @classmethod
    def resolve(cls, config: EngineConfig) -> ModelSource:
        """Find (download, convert) the model and read its config. Raises ModelLoadError (one
        line) for a damaged file, ValueError or OSError for a model that cannot be found."""
        name = model_display_name(config.model)
        with loading(config.model or name):
            folder = resolve_model_folder(
                config.model, revision=config.revision, download_dir=config.download_dir
            )
            model_config = model_config_from_folder(folder)
        tokenizer_folder = (
            resolve_tokenizer_folder(
                config.tokenizer, revision=config.tokenizer_revision, download_dir=config.download_dir
            )
            if config.tokenizer
            else folder
        )
        return cls(name, folder, model_config, tokenizer_folder)

    def load_tokenizer(self, chat_template: str | None) -> PreTrainedTokenizerBase:
        """A new tokenizer of `tokenizer_folder`, with the chat template asked for (--chat-template).
        Each caller gets its own: a tokenizer is not shared across threads that use it at once."""
        folder = self.tokenizer_folder
        with loading_tokenizer(folder):
            return load_tokenizer(folder, chat_template, named_class=gguf_source(folder) is not None)
