"""QuantizationMethod: what every format family answers, so the loader asks the registry, not a name.

A family is found in the model's own files (a GGUF, a checkpoint's quantization_config: `detect`)
or named by --quantization alone (int8/int4 quantize a float checkpoint at load, none dequantizes
whatever the files hold: `after_load`). Either way its weights arrive in the one block form
(BlockQuantized), and the layers' LinearMethod takes it from there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from pagedllm.layers.linear_method import Loaded
from pagedllm.model.checkpoint_quant import CheckpointQuantization, iter_checkpoint_weights
from pagedllm.model.config import ModelConfig


class QuantizationMethod(ABC):
    """A format family (vLLM's QuantizationConfig): a registry row's value."""

    name: ClassVar[str]
    """Its --quantization name (and quantization_config's quant_method, for a checkpoint's)."""
    held_as: ClassVar[str] = ""
    """How a message names a model in this format ("GGUF", "awq checkpoint"); empty for a
    family only --quantization names (its weights are float in the files)."""

    @classmethod
    def detect(cls, folder: Path, quantization_config: dict[str, Any] | None) -> QuantizationMethod | None:
        """This family, read, if the model in `folder` holds its weights in it (config.json's
        quantization_config given as read); ValueError for a variant it does not read."""
        return None

    @classmethod
    @abstractmethod
    def check_flag(cls, own: type[QuantizationMethod] | None) -> None:
        """Refuse --quantization <name> for a model whose files hold `own` (None: float), saying
        what to give instead."""

    @classmethod  # noqa: B027 (a hook: a family the files hold has nothing to do after loading)
    def after_load(cls, model: nn.Module, dtype: torch.dtype) -> None:
        """--quantization <name> on the loaded model (nothing for a family the files hold)."""

    @classmethod
    def bits_at_load(cls) -> float | None:
        """Bits per weight a projection packs into when this method quantizes a float checkpoint
        at load (codes, scales, mins), for the planner; None for a method that does not."""
        return None

    def location(self, folder: Path) -> Path:
        """What messages name as the model: its folder, or the file the folder was converted from."""
        return folder

    def files(self, folder: Path) -> list[Path]:
        """The files the weights are read from."""
        return safetensors_files(folder)

    def weights(
        self, files: list[Path], config: ModelConfig, dequantize: bool = False
    ) -> Iterable[tuple[str, Loaded]]:
        """(Hugging Face name, weight) for every tensor, quantized ones in the block form.
        `dequantize` (--quantization none): a family whose files hold finer values than the block
        form it reads them into (fp8) hands those values as float instead."""
        return iter_safetensors(files)


class HeldByCheckpoint(QuantizationMethod):
    """A safetensors checkpoint whose config.json's quantization_config names this family (vLLM's
    rule: --quantization may name it, or be left out; no other method applies)."""

    def __init__(self, checkpoint: CheckpointQuantization) -> None:
        self.checkpoint = checkpoint

    @classmethod
    @abstractmethod
    def read(cls, config: dict[str, Any]) -> CheckpointQuantization:
        """quantization_config -> the scheme of each projection; ValueError for what is not read."""

    @classmethod
    def detect(cls, folder: Path, quantization_config: dict[str, Any] | None) -> QuantizationMethod | None:
        if not quantization_config or quant_method(quantization_config) != cls.name:
            return None
        return cls(cls.read(quantization_config))

    @classmethod
    def check_flag(cls, own: type[QuantizationMethod] | None) -> None:
        if own is not cls:
            held = (
                f"{own.name}-quantized (give --quantization {own.name}, or leave it out)"
                if own
                else "not quantized"
            )
            raise ValueError(f"--quantization {cls.name}: the model's weights are {held}")

    def weights(
        self, files: list[Path], config: ModelConfig, dequantize: bool = False
    ) -> Iterable[tuple[str, Loaded]]:
        return iter_checkpoint_weights(iter_safetensors(files), self.checkpoint)


def quant_method(quantization_config: dict[str, Any]) -> str:
    """quantization_config's quant_method, as vLLM and transformers compare it."""
    return str(quantization_config.get("quant_method", "")).lower()


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every file, with a progress bar on a terminal (none in logs)."""
    with tqdm(
        total=len(files), desc="Loading safetensors files", unit="file", disable=None, leave=False
    ) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
            bar.update(1)
