"""GGUF files: their quantized blocks kept as stored (model/gguf_weights.py reads them)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedllm.layers.linear_method import Loaded
from pagedllm.model.config import ModelConfig
from pagedllm.model.config_reader import gguf_source
from pagedllm.quantization.base import QuantizationMethod


class GGUF(QuantizationMethod):
    """A .gguf file, served from the folder converted for it (model/gguf_convert.py)."""

    name = "gguf"
    held_as = "GGUF"

    def __init__(self, source: Path) -> None:
        self.source = source

    @classmethod
    def detect(cls, folder: Path, quantization_config: dict[str, Any] | None) -> QuantizationMethod | None:
        source = gguf_source(folder)
        return None if source is None else cls(source)

    @classmethod
    def check_flag(cls, own: type[QuantizationMethod] | None) -> None:
        if own is not cls:
            raise ValueError("--quantization gguf: the model is not a .gguf file")

    def location(self, folder: Path) -> Path:
        return self.source

    def files(self, folder: Path) -> list[Path]:
        return [self.source]

    def weights(
        self, files: list[Path], config: ModelConfig, dequantize: bool = False
    ) -> Iterable[tuple[str, Loaded]]:
        from pagedllm.model.gguf_weights import iter_gguf_weights  # the gguf package, only for a GGUF

        return iter_gguf_weights(self.source, config)
