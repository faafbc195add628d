"""Reading a model's config: config.json (and generation_config.json) of a Hugging Face folder, or
the config.json a GGUF's metadata converts to (model/gguf_metadata.py), into a ModelConfig.

A config comes from a file pagedllm did not write: model_config_from_dict checks every field before
it sizes anything (config_checks.py), model_config_from_folder the config against the tensors the
folder holds (tensor_checks.py), and what is wrong is one ModelLoadError line naming the file and the
field. Each architecture's own fields (rope settings, sliding windows, Gemma 3's, the experts of a
mixture-of-experts model) are read here, with transformers' defaults where the file leaves them out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.model.config import ModelConfig
from pagedllm.model.config_checks import check_config_fields, check_model_config, show
from pagedllm.model.errors import ModelLoadError, loading, read_json
from pagedllm.model.registry import LANGUAGE_MODEL_OF, MODELS
from pagedllm.model.tensor_checks import check_checkpoint_tensors

SUPPORTED_ARCHITECTURES = {architecture: entry.model_type for architecture, entry in MODELS.items()}
"""The architectures pagedllm runs (model/registry.py, the one table of them) -> their model_type."""
GGUF_SOURCE = "gguf_source.txt"
"""In a folder converted from a GGUF (model/gguf_convert.py): the path of the GGUF whose weights it
stands for."""


def gguf_source(folder: Path) -> Path | None:
    """The GGUF a converted folder stands for; None for a plain Hugging Face folder."""
    source = folder / GGUF_SOURCE
    return Path(source.read_text()) if source.exists() else None


def model_config_from_dict(
    config: dict[str, Any],
    generation_config: dict[str, Any] | None = None,
    source: str = "config",
    names: dict[str, str] | None = None,
) -> ModelConfig:
    """The config of a model (config.json's fields), every field checked before it is used
    (model/config_checks.py): ModelLoadError naming `source` and the field otherwise. `names`:
    the fields' names in the file, where it is not a config.json (a GGUF's keys)."""
    try:
        with loading(source):
            return _checked(config, generation_config, source, names)
    except ModelLoadError:
        raise
    except ValueError as error:  # e.g. an architecture or setting pagedllm does not run
        raise ModelLoadError(f"{source}: {error}") from None


def _checked(
    config: dict[str, Any],
    generation_config: dict[str, Any] | None,
    source: str,
    names: dict[str, str] | None,
) -> ModelConfig:
    """model_config_from_dict's work: the checks around the making."""
    qwen2_moe = isinstance(config, dict) and config.get("architectures") == ["Qwen2MoeForCausalLM"]
    if qwen2_moe and config.get("sliding_window") == 0:
        config = {k: v for k, v in config.items() if k != "sliding_window"}  # transformers' "none" there
    check_config_fields(config, source, names, partial=True)
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ModelLoadError(f"{source}: architectures {show(architectures)} is not a list of names")
    if any(a in LANGUAGE_MODEL_OF for a in architectures):
        check_config_fields(config.get("text_config") or {}, f"{source} text_config", partial=True)
        config = _language_model_config(config)
    check_config_fields(config, source, names)
    if generation_config is not None and not isinstance(generation_config, dict):
        raise ModelLoadError(f"{source}: generation_config is not a JSON object")
    model_config = _from_checked_dict(config, generation_config)
    check_model_config(model_config, source)
    return model_config


def _from_checked_dict(config: dict[str, Any], generation_config: dict[str, Any] | None) -> ModelConfig:
    architectures = config.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model architecture {architectures or config.get('model_type')!r} is not supported; "
            f"pagedllm runs {', '.join(sorted([*SUPPORTED_ARCHITECTURES, *LANGUAGE_MODEL_OF]))}"
        )
    num_heads = config["num_attention_heads"]
    rope_scaling, rope_theta = _rope_settings(config)
    if arch == "Gemma3ForCausalLM":  # its own fields, its windows and rope bases among them
        own_fields = _gemma3_settings(config)
        rope_scaling, rope_theta = own_fields.pop("rope_scaling"), own_fields.pop("rope_theta")
    else:
        own_fields = {"layer_windows": _layer_windows(arch, config)}
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        own_fields |= _moe_settings(arch, config)
    return ModelConfig(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", arch == "Gemma3ForCausalLM"),
        attention_bias=_attention_bias(arch, config),
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config, generation_config or {}),
        rope_freq_factors=tuple(config["rope_freq_factors"]) if "rope_freq_factors" in config else None,
        **own_fields,
    )


def model_config_from_folder(folder: str | Path) -> ModelConfig:
    """An HF folder's config, checked against the tensors its safetensors hold; a converted
    GGUF's (whose tensors were checked as it was converted), its errors naming the GGUF."""
    folder = Path(folder)
    gguf_path = gguf_source(folder)
    config = read_json(folder / "config.json")
    gen_path = folder / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else None
    source = str(gguf_path or folder / "config.json")
    model_config = model_config_from_dict(config, generation, source)
    if gguf_path is None:
        check_checkpoint_tensors(folder, model_config)
    return model_config


def _rope_settings(config: dict[str, Any]) -> tuple[dict[str, Any] | None, float]:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs in
    `rope_theta` + `rope_scaling`. Returns (scaling or None, theta)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params or None
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        rest = {key: value for key, value in scaling.items() if key not in ("rope_theta", "type")}
        scaling = None if kind == "default" else {**rest, "rope_type": kind}
    return scaling, float(theta)


def _attention_bias(architecture: str, config: dict[str, Any]) -> bool:
    """Bias on the query, key and value projections: Qwen2's by default, Qwen2-MoE's unless its
    qkv_bias says otherwise, the others' where attention_bias says so."""
    if architecture == "Qwen2MoeForCausalLM":
        return bool(config.get("qkv_bias", True))
    return bool(config.get("attention_bias", architecture == "Qwen2ForCausalLM"))


def _layer_windows(architecture: str, config: dict[str, Any]) -> tuple[int | None, ...] | None:
    """Which layers slide, and by how much, as transformers' Mistral and Qwen2 / Qwen3 decide it
    (their config classes' defaults included: sliding_window 4096, max_window_layers 28), and
    Mixtral (every layer, where its config sets one: MixtralConfig's default is none); Llama has
    no window, whatever its config says."""
    num_layers = config["num_hidden_layers"]
    if architecture == "MixtralForCausalLM":
        window = config.get("sliding_window")
        return None if window is None else (window,) * num_layers
    window = config.get("sliding_window", 4096)
    if architecture == "MistralForCausalLM":
        return None if window is None else (window,) * num_layers
    if architecture == "Qwen2MoeForCausalLM" and config.get("use_sliding_window") and window:
        # transformers' Qwen2-MoE: every other layer below max_window_layers, where layer_types
        # does not say otherwise
        first_full = config.get("max_window_layers", 28)
        layer_types = config.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < first_full else "full_attention"
            for i in range(num_layers)
        ]
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        return windows if any(windows) else None
    if architecture == "Qwen3MoeForCausalLM":  # every layer slides, where the config says so
        return (window,) * num_layers if config.get("use_sliding_window") and window is not None else None
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or window is None:
        return None
    if not config.get("use_sliding_window", False):
        return None
    first = config.get("max_window_layers", 28)
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(windows) else None


def _moe_settings(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts config's expert fields (checked by type and range already). Qwen3-MoE:
    the three sizes every such config.json states, the rest with transformers' defaults. Mixtral:
    every layer sparse, its experts of intermediate_size, their weights always renormalized (its
    config has no field for these), and transformers' 8 experts, top-2 where the file leaves them
    out. The experts' count is num_experts in Qwen3-MoE's released configs, num_local_experts in
    Mixtral's and where transformers 5 saved a Qwen3-MoE config (its attribute_map's name for the
    same field)."""
    if architecture == "MixtralForCausalLM":
        fixed = {
            "moe_intermediate_size": config["intermediate_size"],
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        given = {name: value for name, value in config.items() if value is not None}
        experts = given.get("num_local_experts", given.get("num_experts", 8))
        config = {"num_local_experts": experts, "num_experts_per_tok": 2} | given | fixed
    named = {config.get(name) for name in ("num_experts", "num_local_experts")} - {None}
    if len(named) > 1:
        raise ValueError(
            f"num_experts {config['num_experts']} and num_local_experts "
            f"{config['num_local_experts']} disagree"
        )
    config = config | {"num_experts": next(iter(named), None)}
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if config.get(name) is None:
            raise ValueError(f"{name} is missing; a mixture-of-experts model's config states it")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act {activation!r} is not supported (the experts pagedllm runs: silu)")
    return {
        "num_experts": config["num_experts"],
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "norm_topk_prob": config.get("norm_topk_prob", False),
        "decoder_sparse_step": config.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(sorted(set(config.get("mlp_only_layers") or ()))),
        "shared_expert_intermediate_size": (
            config.get("shared_expert_intermediate_size", 5632)
            if architecture == "Qwen2MoeForCausalLM"
            else None
        ),
    }


def _language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """An image-and-text config's language model as a config of its own. Its text_config names only
    what differs from transformers' defaults (gemma-3-4b-it: five fields), so transformers' config
    class fills the rest; the top level's token ids, tying and dtype apply to it."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**(config.get("text_config") or {})).to_dict()
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
        if config.get(key) is not None:
            text[key] = config[key]
    architecture = next(LANGUAGE_MODEL_OF[a] for a in config["architectures"] if a in LANGUAGE_MODEL_OF)
    return text | {"architectures": [architecture]}


def _gemma3_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own fields: which layers slide (`layer_types`, or older configs' one global layer in
    `sliding_window_pattern`), the two rope bases (transformers 5 keeps them per layer type in
    `rope_parameters`; older configs in `rope_theta`, `rope_local_base_freq`, `rope_scaling`)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(name) is not None:
            raise ValueError(f"{name} is not supported (Gemma 3 has none; this config sets {config[name]})")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: an embedding model, not a decoder pagedllm serves")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {activation!r} is not supported (Gemma 3's: gelu_pytorch_tanh)")
    num_layers = config["num_hidden_layers"]
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    layer_types = config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
    window = config.get("sliding_window")
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        scaling, theta = _rope_settings({"rope_parameters": params["full_attention"]})
        local_scaling, local_theta = _rope_settings(
            {"rope_parameters": params.get("sliding_attention") or {}}
        )
        if local_scaling is not None:
            raise ValueError(f"rope scaling on the sliding-window layers is not supported: {local_scaling}")
    else:
        scaling, theta = _rope_settings(config)
        local_theta = float(config.get("rope_local_base_freq", 10000.0))
    return {
        "rope_scaling": scaling,
        "rope_theta": theta,
        "layer_windows": tuple(window if kind == "sliding_attention" else None for kind in layer_types),
        "local_rope_theta": local_theta,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
    }


def _eos_ids(config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (config.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
