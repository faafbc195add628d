"""GGUF -> a Hugging Face-shaped folder of its metadata (config.json, tokenizer), made once and cached.

The weights stay in the GGUF: the folder names the file (GGUF_SOURCE, which model/config_reader.py's
gguf_source reads back) and model/gguf_weights.py reads its tensors at every load, quantized blocks
as they are. The tokenizer and chat template come from the GGUF metadata through transformers' GGUF
tokenizer converter, then are saved as plain tokenizer files, so the second start reads a folder and
needs no conversion.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.cache_dir import cache_root
from pagedllm.model.config_checks import show
from pagedllm.model.config_reader import GGUF_SOURCE, model_config_from_dict
from pagedllm.model.errors import ModelLoadError, loading, one_line
from pagedllm.model.gguf_file import GGUFContents, read_gguf
from pagedllm.model.gguf_metadata import ARCHITECTURES, MetadataReader, hf_config
from pagedllm.model.tensor_checks import check_tensors_against_config

CONVERTER_VERSION = "3"
"""Part of a conversion's cache key: a new version converts (and checks) every file again."""

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # Gemma 3
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_LAYER_TENSORS = _LAYER_TENSORS | {"ffn_norm": "pre_feedforward_layernorm"}
"""Gemma 3's ffn_norm is the MLP's input norm; its post_attention_norm the attention output's."""
_MOE_LAYER_TENSORS = _LAYER_TENSORS | {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
"""Qwen3-MoE's and Mixtral's router, and their experts stacked one 3-D tensor per projection
[experts, rows, columns] under the name llama.cpp's converter gives the stack (gguf_weights.py
splits it)."""
_QWEN2_MOE_LAYER_TENSORS = _MOE_LAYER_TENSORS | {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
"""Qwen2-MoE's shared expert beside the routed ones, and its gate (one row, which llama.cpp
stores as a vector: hf_tensor_shape)."""
_ARCHITECTURE_LAYER_TENSORS = {
    "Gemma3ForCausalLM": _GEMMA3_LAYER_TENSORS,
    "Qwen2MoeForCausalLM": _QWEN2_MOE_LAYER_TENSORS,
    "Qwen3MoeForCausalLM": _MOE_LAYER_TENSORS,
    "MixtralForCausalLM": _MOE_LAYER_TENSORS,
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _cache_folder(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}".encode()).hexdigest()
    return cache_root() / "gguf" / f"{path.stem}-{key[:12]}"


def converted_folder(gguf_path: str | Path) -> Path:
    """The cached folder (config and tokenizer) for a GGUF file, converting it on first use."""
    path = Path(gguf_path).resolve()
    folder = _cache_folder(path)
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
    try:
        convert_gguf(path, staging)
        try:
            staging.rename(folder)
        except OSError:  # another process finished first; its copy is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def gguf_hf_config(gguf_path: str | Path) -> dict[str, Any]:
    """The config.json a GGUF converts to, without converting it: from the cached conversion when
    there is one, else from the metadata alone (the file is memory-mapped, no weight is read or
    dequantized)."""
    cached = _cache_folder(Path(gguf_path).resolve()) / "config.json"
    if cached.exists():
        return json.loads(cached.read_text())
    return _config_of(read_gguf(Path(gguf_path)), Path(gguf_path))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """config.json, the tokenizer files and GGUF_SOURCE into `out_dir`; no weights. The file's
    metadata and tensor directory are checked first (ModelLoadError naming what is wrong)."""
    config = _config_of(read_gguf(gguf_path), gguf_path)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / GGUF_SOURCE).write_text(str(gguf_path))
    try:
        _save_tokenizer(gguf_path, out_dir, config["model_type"])
    except Exception as error:  # transformers' converter, on metadata it trusts: any error is the file's
        raise ModelLoadError(
            f"{gguf_path}: its tokenizer could not be converted ({type(error).__name__}: {one_line(error)})"
        ) from error


def _config_of(contents: GGUFContents, path: Path) -> dict[str, Any]:
    """The config.json of a GGUF's metadata, checked as a config.json is (model/config_checks.py)
    and against the tensors the file holds: ModelLoadError naming the file and the key."""
    arch = contents.metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: metadata 'general.architecture' is missing; a model's GGUF states it")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: general.architecture {show(arch)} is not supported; "
            f"pagedllm reads {sorted(ARCHITECTURES)}"
        )
    with loading(path):
        metadata = MetadataReader(contents, path)
        config = hf_config(metadata, arch)
        config["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in contents.tensors)
        model_config = model_config_from_dict(config, source=str(path), names=metadata.field_names(arch))
        names = {
            tensor.name: hf_tensor_name(tensor.name, model_config.architecture, path)
            for tensor in contents.tensors
            if tensor.name != "rope_freqs.weight"
        }
        listed = [
            (names[tensor.name], hf_tensor_shape(names[tensor.name], tensor.shape), tensor.name)
            for tensor in contents.tensors
            if tensor.name in names
        ]
        check_tensors_against_config(listed, model_config, str(path))
    return config


def hf_tensor_shape(hf_name: str, gguf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GGUF tensor's shape as its checkpoint holds it, [out, in]: the GGUF's reversed, and
    Qwen2-MoE's shared-expert gate, a vector in the file, as the one-row matrix it is."""
    shape = tuple(reversed(gguf_shape))
    return (1, *shape) if hf_name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1 else shape


def hf_tensor_name(gguf_name: str, architecture: str, path: Path | None = None) -> str:
    """A GGUF tensor's Hugging Face name in a model of `architecture` (config.json's);
    ModelLoadError (naming `path`) for a tensor no such model has."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _ARCHITECTURE_LAYER_TENSORS.get(architecture, _LAYER_TENSORS)
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isascii()
        and parts[1].isdigit()
        and parts[2] in layer_tensors
        and parts[3] in ("weight", "bias")
    ):
        return f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"{path or 'GGUF'}: tensor {gguf_name!r} is not one a {architecture} has")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permutation: per head, rows were interleaved
    (pairs) for its rotary layout; Hugging Face's rotate-half wants them in two halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _save_tokenizer(gguf_path: Path, out_dir: Path, model_type: str) -> None:
    """transformers' conversion of the file's tokenizer, in the class AutoTokenizer would pick for
    `model_type` (its fallback TokenizersBackend where none is registered). Named here because
    AutoTokenizer first rebuilds the model's config from the file with the `gguf` package's
    reader, seconds on a large vocabulary, only to choose that class."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class_name = TOKENIZER_MAPPING_NAMES.get(model_type)
    tokenizer_class = (tokenizer_class_from_name(class_name) if class_name else None) or TokenizersBackend
    tokenizer = tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
