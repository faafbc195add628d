"""Load a model's weights: build the model on the meta device, then read each checkpoint tensor
through the layer that owns it, in the form the files' quantization method gives (quantization/).

It sits above both model/ (the architectures, and finding their files: model/locate.py) and
quantization/ (the format families, which read files through model/), so neither imports the other's
layer back.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Loaded, copy_weight
from pagedllm.layers.quantization import BlockQuantized
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.checkpoint_quant import CheckpointQuantization
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import ModelLoadError, loading, one_line
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.registry import MODELS, checkpoint_tensor_name
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


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class that runs `architecture` (a MODELS key: a ModelConfig has no other), imported from
    the module its registry row names."""
    entry = MODELS[architecture]
    cls: type[LlamaForCausalLM] = getattr(
        importlib.import_module(f"pagedllm.model.{entry.module}"), entry.class_name
    )
    return cls


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
        hf_name = checkpoint_tensor_name(checkpoint_name, model.config.architecture)
        if hf_name is None:
            not_loaded += 1
            continue
        if "rotary_emb" in hf_name or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard_id = _our_name(hf_name, model.packed_modules_mapping)
        if name not in params and _another_ranks_expert(model, name):
            continue
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


_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\..+")


def _another_ranks_expert(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is an expert that another tensor-parallel rank holds."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return False
    try:
        experts = model.get_submodule(match.group(1))
    except AttributeError:
        return False
    expert = int(match.group(2))
    return isinstance(experts, FusedMoE) and expert < experts.num_experts and not experts.owns(expert)


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
