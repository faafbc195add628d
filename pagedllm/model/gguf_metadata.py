"""A GGUF's metadata as the config.json it stands for: llama.cpp's keys under Hugging Face's names.

Every key is read by type (an integer where a count is meant, a finite number where a float is)
and the result goes through the same checks as a config.json (model/config_checks.py), with the
file's own key and its offset in each error, so a damaged GGUF is answered in its own terms:

    model.gguf: llama.block_count (offset 312) 200000000 is not an integer in [1, 1,024] ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from pagedllm.model.config_checks import MODEL_BOUNDS, check_config_fields, is_number, show
from pagedllm.model.errors import ModelLoadError
from pagedllm.model.gguf_file import GGUFContents
from pagedllm.model.registry import MODELS

ARCHITECTURES = {entry.gguf_architecture: name for name, entry in MODELS.items() if entry.gguf_architecture}
"""general.architecture -> config.json's architecture (model/registry.py's rows)."""
EXPERTS_ARCHITECTURES = {"llama": "MixtralForCausalLM"}
"""general.architecture -> the architecture a file of it is where its layers hold experts
(`<arch>.expert_count` above 0): llama.cpp writes Mixtral as "llama" (its graph builds a mixture
of experts wherever a layer has a router), so the expert count is all that tells the two apart."""
FIELD_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
    "rope_local_base_freq": "rope.freq_base_swa",
    "vocab_size": "vocab_size",
    "layer_types": "attention.sliding_window_pattern",
    "num_experts": "expert_count",
    "num_local_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
}
"""config.json's field -> the GGUF key it comes from (under the architecture's prefix)."""
_REQUIRED = object()


class MetadataReader:
    """Typed reads of a GGUF's metadata, each error naming the file, the key and its offset."""

    def __init__(self, contents: GGUFContents, path: Path) -> None:
        self.contents, self.path = contents, path

    def where(self, key: str) -> str:
        offset = self.contents.key_offsets.get(key)
        return key if offset is None else f"{key} (offset {offset:,})"

    def fail(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: metadata {self.where(key)} {problem}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.contents.metadata.get(key, default)

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        """An integer value (`default` where absent; ModelLoadError where absent without one)."""
        value = self.get(key, default)
        if value is _REQUIRED:
            raise self.fail(key, f"is missing; a {key.split('.')[0]} GGUF states it")
        if value is not None and type(value) is not int:
            raise self.fail(key, f"is {show(value)}, not an integer")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if not is_number(value):
            raise self.fail(key, f"is {show(value)}, not a finite number")
        return float(value)

    def field_names(self, arch: str) -> dict[str, str]:
        """config.json's field -> the file's key (and offset), for config_checks' errors."""
        names = {field: self.where(f"{arch}.{key}") for field, key in FIELD_KEYS.items()}
        return names | {
            "bos_token_id": self.where("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.where("tokenizer.ggml.eos_token_id"),
        }


def model_architecture(metadata: MetadataReader, arch: str) -> str:
    """config.json's architecture for a file of general.architecture `arch` (an ARCHITECTURES key):
    its row's, or EXPERTS_ARCHITECTURES' where the file states experts."""
    if arch in EXPERTS_ARCHITECTURES and (metadata.integer(f"{arch}.expert_count", None) or 0) > 0:
        return EXPERTS_ARCHITECTURES[arch]
    return ARCHITECTURES[arch]


def hf_config(metadata: MetadataReader, arch: str) -> dict[str, Any]:
    """The config.json of `arch`'s metadata, its fields checked before any is used to size a loop."""
    p, path = f"{arch}.", metadata.path
    architecture = model_architecture(metadata, arch)
    num_heads = metadata.integer(p + "attention.head_count")
    hidden = metadata.integer(p + "embedding_length")
    # Qwen3 states head_dim (key_length), which need not be hidden / heads; where neither is
    # given, ModelConfig takes hidden / heads once it has checked that they divide
    head_dim = metadata.integer(p + "attention.key_length", None) or metadata.integer(
        p + "rope.dimension_count", None
    )
    num_tokens = metadata.contents.array_lengths.get("tokenizer.ggml.tokens")
    vocab = metadata.integer(p + "vocab_size", None) or num_tokens
    if vocab is None:
        raise ModelLoadError(f"{path}: neither {p}vocab_size nor tokenizer.ggml.tokens says the vocabulary")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": MODELS[architecture].model_type,  # qwen3moe's is qwen3_moe
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": metadata.integer(p + "feed_forward_length", _dense_width(metadata, arch)),
        "num_hidden_layers": metadata.integer(p + "block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": metadata.integer(p + "attention.head_count_kv", None) or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": metadata.number(p + "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": metadata.number(p + "rope.freq_base", 10000.0),
        "max_position_embeddings": metadata.integer(p + "context_length", 2048),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
    }
    _check_token_ids_in_tokenizer(metadata, config, num_tokens)
    scaling_type = metadata.get(p + "rope.scaling.type")
    if scaling_type == "linear":
        factor = metadata.get(p + "rope.scaling.factor")
        if not is_number(factor) or factor <= 0:
            state = "is missing" if factor is None else f"is {show(factor)}, not a positive number"
            raise metadata.fail(p + "rope.scaling.factor", f"{state} (linear rope scaling needs it)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif scaling_type not in (None, "none"):
        raise metadata.fail(p + "rope.scaling.type", f"{show(scaling_type)} is not supported (linear is)")
    if arch == "gemma3":
        check_config_fields(config, str(path), metadata.field_names(arch))  # before a loop over its layers
        config |= _gemma3_config(metadata, config)
    if arch in ("qwen3moe", "qwen2moe"):
        config |= _experts_config(metadata, arch)
    if architecture == "MixtralForCausalLM":  # all layers sparse, experts of feed_forward_length
        config["num_local_experts"] = metadata.integer(p + "expert_count")
        config["num_experts_per_tok"] = metadata.integer(p + "expert_used_count")
    for tensor in metadata.contents.tensors:
        if tensor.name == "rope_freqs.weight":  # Llama 3.1+: per-frequency divisors
            if len(tensor.shape) != 1 or tensor.shape[0] > MODEL_BOUNDS["head_dim"][1]:
                raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' has shape {list(tensor.shape)}")
            config["rope_freq_factors"] = [float(x) for x in gguf.dequantize(tensor.data, tensor.tensor_type)]
    return config


def _check_token_ids_in_tokenizer(
    metadata: MetadataReader, config: dict[str, Any], num_tokens: int | None
) -> None:
    """BOS and EOS must be tokens of the file's own vocabulary (tokenizer.ggml.tokens), which the
    tokenizer converter indexes by them."""
    for field in ("bos_token_id", "eos_token_id"):
        token_id = config[field]
        if (
            token_id is not None
            and num_tokens is not None
            and (type(token_id) is not int or not 0 <= token_id < num_tokens)
        ):
            raise metadata.fail(
                f"tokenizer.ggml.{field}",
                f"{show(token_id)} is not a token of tokenizer.ggml.tokens (0 to {num_tokens - 1:,})",
            )


def _dense_width(metadata: MetadataReader, arch: str) -> Any:
    """feed_forward_length's default: none (a dense model states it), but a Qwen3-MoE or Qwen2-MoE
    file whose layers are all sparse may leave it out: then its experts' width, which no tensor is
    checked by."""
    if arch in ("qwen3moe", "qwen2moe"):
        return metadata.integer(f"{arch}.expert_feed_forward_length")
    return _REQUIRED


def _experts_config(metadata: MetadataReader, arch: str) -> dict[str, Any]:
    """The experts' sizes, and what llama.cpp's graph fixes: the chosen experts' weights
    renormalized for Qwen3-MoE, not for Qwen2-MoE (whose shared expert's width the file states).
    llama.cpp makes every layer sparse; a layer that holds a dense MLP (ffn_down) instead of a
    router is read as one of mlp_only_layers (transformers' configs may name some)."""
    p = f"{arch}."
    dense = {
        int(parts[1])
        for tensor in metadata.contents.tensors
        if len(parts := tensor.name.split(".")) == 4
        and parts[0] == "blk"
        and parts[1].isascii()
        and parts[1].isdigit()
        and parts[2] == "ffn_down"
    }
    return {
        "num_experts": metadata.integer(p + "expert_count"),
        "num_experts_per_tok": metadata.integer(p + "expert_used_count"),
        "moe_intermediate_size": metadata.integer(p + "expert_feed_forward_length"),
        "norm_topk_prob": arch == "qwen3moe",
        "mlp_only_layers": sorted(dense),
    } | (
        {"shared_expert_intermediate_size": metadata.integer(p + "expert_shared_feed_forward_length")}
        if arch == "qwen2moe"
        else {}
    )


def _gemma3_config(metadata: MetadataReader, config: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3's file leaves to llama.cpp's code: one global layer in 6 (unless the file lists
    the sliding layers), a local rope base of 10,000, scores scaled by head_dim ** -0.5 except on
    the 27B (62 layers: hidden / heads). `config`'s sizes have been checked."""
    p = "gemma3."
    key = p + "attention.sliding_window_pattern"
    pattern = metadata.get(key, 6)
    layers = config["num_hidden_layers"]
    most = MODEL_BOUNDS["sliding_window_pattern"][1]
    if isinstance(pattern, list):  # per layer: True where it slides
        if len(pattern) != layers:
            raise metadata.fail(key, f"has {len(pattern)} entries for {layers} layers")
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    elif type(pattern) is int and 1 <= pattern <= most:
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
    else:
        raise metadata.fail(key, f"is {show(pattern)}, not a layer count in [1, {most}] or a list per layer")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return {
        "sliding_window": metadata.integer(p + "attention.sliding_window"),
        "layer_types": layer_types,
        "rope_local_base_freq": metadata.number(p + "rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"] or hidden // heads,
        "hidden_activation": "gelu_pytorch_tanh",
    }
