"""A model's config checked before anything is built from it: each field's type and range, then
the fields against each other.

A config is read from a file pagedllm did not write (config.json, a GGUF's metadata), and every
figure in it sizes something: `num_hidden_layers` layers are built one by one, `vocab_size` rows
allocated, `sliding_window_pattern` divided by. A field beyond any real model's (MODEL_BOUNDS) is
a damaged or hostile file, refused with a ModelLoadError naming the file and the field before a
byte is allocated or a loop run over it; `pagedllm plan` runs the same checks, so it refuses what
`serve` would refuse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from pagedllm.model.errors import ModelLoadError

if TYPE_CHECKING:
    from pagedllm.model.config import ModelConfig

MODEL_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 2**17),
    "intermediate_size": (1, 2**20),
    "vocab_size": (1, 2**22),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024),
    "max_position_embeddings": (1, 2**24),
    "sliding_window": (1, 2**24),
    "max_window_layers": (0, 1024),
    "sliding_window_pattern": (1, 1024),
    "_sliding_window_pattern": (1, 1024),
    "num_experts": (1, 4096),
    "num_local_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 2**20),
    "shared_expert_intermediate_size": (1, 2**20),
    "decoder_sparse_step": (1, 1024),
}
"""The most any real model has, with room to spare (the largest open models of 2025: 126 layers,
hidden 16,384 or 53,248 MLP, 262,144 tokens, 128 heads, head_dim 512, 10M context, 512 experts of
which 10 a token): a config beyond one of these is damaged or hostile, not a model too large for
this host."""
MAX_EXPERTS = 2**17
"""Experts over all sparse layers: each is built as modules of its own (~0.2 ms and a few KiB
apiece, whatever its size), so a tiny config of 4,096 experts on 1,024 layers would take minutes
and gigabytes with few parameters. The most of any open model is ~25,000 (Qwen3-Next: 512 x 48)."""
MAX_PARAMETERS = 2**41
"""~2.2 trillion: above the largest open model (1T); the fields' product is bounded too."""
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e15),
    "rope_local_base_freq": (0.0, 1e15),
    "query_pre_attn_scalar": (0.0, 2.0**20),
}
"""Finite numbers strictly above the low bound and at most the high one."""
ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""The rope scalings the engine computes (layers/rotary.py), each with the numbers it needs."""
MAX_ROPE_NUMBER = 2.0**24
TORCH_DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float64", "float", "half", "double", "float8_e4m3fn", "float8_e5m2"}
)
"""config.json's torch_dtype / dtype: a name torch has (transformers looks it up as torch.<name>)."""
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "qkv_bias", "use_sliding_window", "norm_topk_prob")
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def check_config_fields(
    config: Any, source: str, names: Mapping[str, str] | None = None, *, partial: bool = False
) -> None:
    """Each field a ModelConfig is made from, by type and range, before any is used. `names`:
    the file's own name for a field where it is not config.json's (a GGUF's metadata keys).
    `partial`: only the fields given are checked (an image-and-text config's text_config, which
    names only what differs from transformers' defaults)."""
    names = names or {}

    def fail(field: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{source}: {names.get(field, field)} {problem}")

    if not isinstance(config, dict):
        raise ModelLoadError(f"{source}: not a JSON object of model settings ({type(config).__name__})")
    if not partial:
        for field in REQUIRED_FIELDS:
            if config.get(field) is None:
                raise fail(field, "is missing; a model's config states it")
    for field, (low, high) in MODEL_BOUNDS.items():
        value = config.get(field)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise fail(field, f"{show(value)} is not an integer in [{low:,}, {high:,}] (no real model's is)")
    for field, (above, most) in FLOAT_BOUNDS.items():
        value = config.get(field)
        if value is not None and not (is_number(value) and above < value <= most):
            raise fail(field, f"{show(value)} is not a finite number in ({above:g}, {most:g}]")
    for field in BOOL_FIELDS:
        if config.get(field) is not None and type(config[field]) is not bool:
            raise fail(field, f"{show(config[field])} is not true or false")
    for field in ("torch_dtype", "dtype"):
        if config.get(field) is not None and not (
            isinstance(config[field], str) and config[field] in TORCH_DTYPES
        ):
            raise fail(field, f"{show(config[field])} is not a dtype ({', '.join(sorted(TORCH_DTYPES))})")
    for field in ("rope_scaling", "rope_parameters", "text_config"):
        if config.get(field) is not None and not isinstance(config[field], dict):
            raise fail(field, f"{show(config[field])} is not an object of settings")
    if partial:
        return
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config.get("head_dim") is None and hidden % heads:
        raise fail(
            "hidden_size", f"{hidden} is not a multiple of num_attention_heads {heads} (no head_dim given)"
        )
    layer_types = config.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list)
        or len(layer_types) != config["num_hidden_layers"]
        or not all(isinstance(kind, str) and kind in LAYER_TYPES for kind in layer_types)
    ):
        raise fail(
            "layer_types",
            f"{show(layer_types)} is not one of {sorted(LAYER_TYPES)} per layer "
            f"({config['num_hidden_layers']} layers)",
        )
    layers = config.get("mlp_only_layers")
    if layers is not None and (
        not isinstance(layers, list)
        or len(layers) > config["num_hidden_layers"]
        or not all(type(i) is int and 0 <= i < config["num_hidden_layers"] for i in layers)
    ):
        raise fail(
            "mlp_only_layers",
            f"{show(layers)} is not a list of layer indices (0 to {config['num_hidden_layers'] - 1})",
        )
    _check_token_ids(config, fail)


def _check_token_ids(config: dict[str, Any], fail: Any) -> None:
    vocab = config["vocab_size"]
    for field in ("bos_token_id", "eos_token_id"):
        value = config.get(field)
        ids = value if isinstance(value, list) and field == "eos_token_id" else [value]
        for token_id in ids:
            if token_id is not None and (type(token_id) is not int or not 0 <= token_id < vocab):
                raise fail(
                    field, f"{show(token_id)} is not a token id of the vocabulary (0 to {vocab - 1:,})"
                )


def check_rope_scaling(scaling: dict[str, Any] | None, source: str, field: str = "rope_scaling") -> None:
    """A rope scaling the engine computes, with every number it needs, each a finite positive one."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_FIELDS:
        raise ModelLoadError(
            f"{source}: {field} type {show(kind)} is not supported "
            f"(default, {', '.join(ROPE_SCALING_FIELDS)} are)"
        )
    for name in ROPE_SCALING_FIELDS[kind]:
        value = scaling.get(name)
        if not (is_number(value) and 0 < value <= MAX_ROPE_NUMBER):
            state = "is missing" if value is None else f"is {show(value)}, not a finite positive number"
            raise ModelLoadError(f"{source}: {field}.{name} {state} ({kind} scaling needs it)")
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ModelLoadError(f"{source}: {field}: low_freq_factor must be below high_freq_factor")


def check_model_config(config: ModelConfig, source: str) -> None:
    """The fields against each other, once the config is made (model_config_from_dict runs it)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
        )
    if config.head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim {config.head_dim} is odd; rotary needs pairs")
    low, high = MODEL_BOUNDS["head_dim"]
    if not low <= config.head_dim <= high:  # (hidden_size / heads where no head_dim is given)
        raise ModelLoadError(f"{source}: head_dim {config.head_dim} is not in [{low}, {high}]")
    check_rope_scaling(config.rope_scaling, source)
    for name, theta in (("rope_theta", config.rope_theta), ("local rope_theta", config.local_rope_theta)):
        if theta is not None and not (is_number(theta) and 0 < theta <= FLOAT_BOUNDS["rope_theta"][1]):
            raise ModelLoadError(f"{source}: {name} {show(theta)} is not a finite positive number")
    factors = config.rope_freq_factors
    if factors is not None and (
        len(factors) != config.head_dim // 2 or not all(is_number(f) and f > 0 for f in factors)
    ):
        raise ModelLoadError(
            f"{source}: rope_freq_factors: {len(factors)} values, {config.head_dim // 2} positive ones needed"
        )
    _check_experts(config, source)
    windows = config.layer_windows
    if windows is not None and len(windows) != config.num_hidden_layers:
        raise ModelLoadError(f"{source}: {len(windows)} layer windows for {config.num_hidden_layers} layers")
    if windows is not None and not all(w is None or (type(w) is int and w >= 1) for w in windows):
        raise ModelLoadError(f"{source}: sliding_window must be a positive integer")
    for token_id in config.eos_token_ids:
        if not 0 <= token_id < config.vocab_size:
            raise ModelLoadError(
                f"{source}: eos_token_id {token_id} is not a token id of the vocabulary "
                f"(0 to {config.vocab_size - 1:,})"
            )
    if config.num_parameters() > MAX_PARAMETERS:
        raise ModelLoadError(
            f"{source}: its sizes make {config.num_parameters():,} parameters, more than any model has "
            f"({MAX_PARAMETERS:,})"
        )


def _check_experts(config: ModelConfig, source: str) -> None:
    """A mixture-of-experts model's sizes together: each token routes to that many distinct experts."""
    experts, per_token = config.num_experts, config.num_experts_per_tok
    if experts is None:
        return
    assert per_token is not None  # ModelConfig states the expert sizes together or none of them
    if per_token > experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok {per_token} is more than num_experts {experts}: each token "
            "is routed to that many distinct experts"
        )
    if experts * config.num_sparse_layers > MAX_EXPERTS:
        raise ModelLoadError(
            f"{source}: num_experts {experts} on {config.num_sparse_layers} sparse layers make "
            f"{experts * config.num_sparse_layers:,} experts, more than any model has ({MAX_EXPERTS:,})"
        )


def is_number(value: Any) -> TypeGuard[float]:
    """A finite int or float, not a bool (which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def show(value: Any) -> str:
    """A field's value for an error line: short, and never a deep structure's repr."""
    if isinstance(value, list | dict | tuple):
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
