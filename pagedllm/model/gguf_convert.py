"""GGUF -> a Hugging Face-shaped folder of its metadata (config.json, tokenizer), made once and cached.

The weights stay in the GGUF: the folder names the file (GGUF_SOURCE) and model/gguf_weights.py
reads its tensors at every load, quantized blocks as they are. The tokenizer and chat template
come from the GGUF metadata through transformers' GGUF tokenizer converter, then are saved as
plain tokenizer files, so the second start reads a folder and needs no conversion.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pagedllm.cache_dir import cache_root
from pagedllm.model.gguf_file import GGUFContents, read_gguf

CONVERTER_VERSION = "2"
GGUF_SOURCE = "gguf_source.txt"
"""In a converted folder: the path of the GGUF whose weights it stands for."""

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
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
    return _config_of(read_gguf(Path(gguf_path)))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """config.json, the tokenizer files and GGUF_SOURCE into `out_dir`; no weights."""
    config = _config_of(read_gguf(gguf_path))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / GGUF_SOURCE).write_text(str(gguf_path))
    _save_tokenizer(gguf_path, out_dir, config["model_type"])


def gguf_source(folder: Path) -> Path | None:
    """The GGUF a converted folder stands for; None for a plain Hugging Face folder."""
    source = folder / GGUF_SOURCE
    return Path(source.read_text()) if source.exists() else None


def _config_of(contents: GGUFContents) -> dict[str, Any]:
    arch = contents.metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; pagedllm reads {sorted(_ARCHITECTURES)}"
        )
    config = _hf_config(contents, arch)
    config["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in contents.tensors)
    return config


def _hf_config(contents: GGUFContents, arch: str) -> dict[str, Any]:
    md, p = contents.metadata, f"{arch}."
    num_heads = int(md[p + "attention.head_count"])
    hidden = int(md[p + "embedding_length"])
    # Qwen3 states head_dim (key_length), which need not be hidden / heads
    head_dim = int(
        md.get(p + "attention.key_length") or md.get(p + "rope.dimension_count") or hidden // num_heads
    )
    vocab = md.get(p + "vocab_size") or contents.array_lengths["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(md[p + "feed_forward_length"]),
        "num_hidden_layers": int(md[p + "block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(md.get(p + "attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(md.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(md.get(p + "context_length", 2048)),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
    }
    scaling_type = md.get(p + "rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(md[p + "rope.scaling.factor"])}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    if arch == "gemma3":
        config |= _gemma3_config(md, config)
    for tensor in contents.tensors:
        if tensor.name == "rope_freqs.weight":  # Llama 3.1+: per-frequency divisors
            config["rope_freq_factors"] = [float(x) for x in gguf.dequantize(tensor.data, tensor.tensor_type)]
    return config


def _gemma3_config(md: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3's file leaves to llama.cpp's code: one global layer in 6 (unless the file lists
    the sliding layers), a local rope base of 10,000, scores scaled by head_dim ** -0.5 except on
    the 27B (62 layers: hidden / heads)."""
    p = "gemma3."
    pattern = md.get(p + "attention.sliding_window_pattern", 6)
    layers = config["num_hidden_layers"]
    if isinstance(pattern, list):  # per layer: True where it slides
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        layer_types = [
            "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(layers)
        ]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return {
        "sliding_window": int(md[p + "attention.sliding_window"]),
        "layer_types": layer_types,
        "rope_local_base_freq": float(md.get(p + "rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


def hf_tensor_name(gguf_name: str, architecture: str) -> str:
    """A GGUF tensor's Hugging Face name in a model of `architecture` (config.json's)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _GEMMA3_LAYER_TENSORS if architecture == "Gemma3ForCausalLM" else _LAYER_TENSORS
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


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
