"""ModelConfig: the shape of a Llama-family, Gemma 3 or Qwen3-MoE model, read from a Hugging Face
config.json.

Names are Hugging Face's, so a config and its weights map one to one. GGUF metadata is
translated into this same form (see gguf_metadata.py), so there is one reader. A config comes
from a file pagedllm did not write: from_dict checks every field before it sizes anything
(config_checks.py), from_folder the config against the tensors the folder holds (tensor_checks.py),
and what is wrong is one ModelLoadError line naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.model.config_checks import check_config_fields, check_model_config, show
from pagedllm.model.errors import ModelLoadError, loading
from pagedllm.model.registry import LANGUAGE_MODEL_OF, MODELS

SUPPORTED_ARCHITECTURES = {architecture: entry.model_type for architecture, entry in MODELS.items()}
"""The architectures pagedllm runs (model/registry.py, the one table of them) -> their model_type."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_freq_factors: tuple[float, ...] | None = None
    """Llama 3.1+ GGUFs carry rope scaling as per-frequency divisors instead of parameters."""
    layer_windows: tuple[int | None, ...] | None = None
    """Per layer, the sliding window its attention keeps to (None: every key), as transformers'
    layers apply one (Mistral: every layer; Qwen2 / Qwen3 with use_sliding_window: the layers from
    max_window_layers on; Gemma 3: five local layers to one global); None where no layer slides."""
    local_rope_theta: float | None = None
    """The rope base of the sliding-window layers where it is their own (Gemma 3), unscaled."""
    query_pre_attn_scalar: float | None = None
    """Gemma: attention scores scaled by this ** -0.5 instead of head_dim ** -0.5."""
    num_experts: int | None = None
    """A mixture-of-experts model's experts on each sparse layer (None: a dense model). The sizes
    below are set together with it, as transformers' Qwen3MoeConfig names them."""
    num_experts_per_tok: int | None = None
    """The experts each token is routed to (top-k of the router's softmax)."""
    moe_intermediate_size: int | None = None
    """Each expert's gated MLP width (the dense layers' is intermediate_size)."""
    norm_topk_prob: bool = False
    """The chosen experts' weights renormalized to sum to 1."""
    decoder_sparse_step: int = 1
    """Every this-many-th layer is sparse (layer i where (i + 1) % step == 0) ..."""
    mlp_only_layers: tuple[int, ...] = ()
    """... except these, which keep the dense MLP."""

    @classmethod
    def from_dict(
        cls,
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
                return cls._checked(config, generation_config, source, names)
        except ModelLoadError:
            raise
        except ValueError as error:  # e.g. an architecture or setting pagedllm does not run
            raise ModelLoadError(f"{source}: {error}") from None

    @classmethod
    def _checked(
        cls,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None,
        source: str,
        names: dict[str, str] | None,
    ) -> ModelConfig:
        """from_dict's work: the checks around the making."""
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
        model_config = cls._from_checked_dict(config, generation_config)
        check_model_config(model_config, source)
        return model_config

    @classmethod
    def _from_checked_dict(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None
    ) -> ModelConfig:
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
        if arch == "Qwen3MoeForCausalLM":
            own_fields |= _moe_settings(config)
        return cls(
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
            attention_bias=config.get("attention_bias", arch == "Qwen2ForCausalLM"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos_ids(config, generation_config or {}),
            rope_freq_factors=tuple(config["rope_freq_factors"]) if "rope_freq_factors" in config else None,
            **own_fields,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """An HF folder's config, checked against the tensors its safetensors hold; a converted
        GGUF's (whose tensors were checked as it was converted), its errors naming the GGUF."""
        from pagedllm.model.gguf_convert import gguf_source
        from pagedllm.model.tensor_checks import check_checkpoint_tensors

        folder = Path(folder)
        gguf_path = gguf_source(folder)
        config = read_json(folder / "config.json")
        gen_path = folder / "generation_config.json"
        generation = read_json(gen_path) if gen_path.exists() else None
        source = str(gguf_path or folder / "config.json")
        model_config = cls.from_dict(config, generation, source)
        if gguf_path is None:
            check_checkpoint_tensors(folder, model_config)
        return model_config

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` has experts in place of the dense MLP (transformers' rule)."""
        return (
            self.num_experts is not None
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(index) for index in range(self.num_hidden_layers))

    def _experts_parameters(self) -> tuple[int, int]:
        """A sparse layer's (expert projections, router) parameters, all experts together."""
        assert self.num_experts is not None and self.moe_intermediate_size is not None
        h = self.hidden_size
        return self.num_experts * 3 * h * self.moe_intermediate_size, self.num_experts * h

    @property
    def attention_scale(self) -> float:
        """What scores are scaled by: query_pre_attn_scalar ** -0.5 where the model sets it (Gemma),
        else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_parameters(self, tp_size: int = 1) -> int:
        """Parameter count from the shapes alone (for planning without weights); with tensor
        parallelism one rank's: the layers' projections split, embeddings and norms whole, an
        untied LM head split where the ranks divide the vocabulary (a tied one is the embedding)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        norms = {
            "Qwen3ForCausalLM": 2 * h + 2 * self.head_dim,
            "Qwen3MoeForCausalLM": 2 * h + 2 * self.head_dim,
            "Gemma3ForCausalLM": 4 * h + 2 * self.head_dim,
        }.get(self.architecture, 2 * h)  # 2 or 4 per layer, plus q/k_norm
        per_layer = (attn + 3 * h * i) // tp_size + norms
        head_rows = self.vocab_size // tp_size if self.vocab_size % tp_size == 0 else self.vocab_size
        embeddings = self.vocab_size * h + (0 if self.tie_word_embeddings else head_rows * h)
        experts = 0
        if self.num_experts is not None:  # experts and their router in place of the dense MLP
            experts = self.num_sparse_layers * (sum(self._experts_parameters()) - 3 * h * i)
        return layers * per_layer + experts + embeddings + h

    def active_parameters(self, tp_size: int = 1) -> int:
        """The parameters one token's forward pass uses, one rank's share: num_parameters less the
        experts a token is not routed to (num_experts - num_experts_per_tok on each sparse layer);
        every parameter for a dense model. As model cards count them (Qwen3-30B-A3B: 3.3B of 30.5B):
        embeddings and LM head included."""
        total = self.num_parameters(tp_size)
        if self.num_experts is None or self.num_experts_per_tok is None:
            return total
        per_expert = self._experts_parameters()[0] // self.num_experts
        idle = self.num_sparse_layers * (self.num_experts - self.num_experts_per_tok) * per_expert
        return total - idle // tp_size

    def projection_parameters(self, tp_size: int = 1) -> int:
        """The layers' projection weights (q/k/v/o, gate/up/down, each expert's), one rank's share:
        what --quantization int8/int4 quantizes (not a router, which stays float)."""
        h, mlp = self.hidden_size, 3 * self.hidden_size * self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + mlp
        experts = 0
        if self.num_experts is not None:  # each sparse layer's experts in place of the dense MLP
            experts = self.num_sparse_layers * (self._experts_parameters()[0] - mlp)
        return (self.num_hidden_layers * per_layer + experts) // tp_size

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """Raise ValueError, naming the sizes that work, unless every rank gets whole heads. A
        mixture-of-experts model runs on one rank (its experts are not split yet)."""
        if self.num_experts is not None and tp_size > 1:
            raise ValueError(
                f"tensor_parallel_size: {tp_size}: {self.architecture}, a mixture-of-experts model, runs "
                "on one rank for now (its experts are not split over ranks); give tensor_parallel_size 1"
            )
        counts = {
            "attention heads": self.num_attention_heads,
            "KV heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
        }
        for name, count in counts.items():
            if count % tp_size:
                common = math.gcd(*counts.values())
                sizes = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
                raise ValueError(
                    f"tensor_parallel_size: {tp_size} does not divide this model's {count} {name}, and "
                    f"each rank must own an equal share; sizes that work for this model: {sizes}"
                )

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context the engine serves: `requested` or the model's; ValueError over the model's.
        A sliding window does not cap it: the layers apply their windows."""
        model_max = self.max_position_embeddings
        if requested is not None and requested > model_max:
            raise ValueError(
                f"max_model_len: {requested:,} is over the model's context of {model_max:,} tokens"
            )
        return requested or model_max


def read_json(path: Path) -> Any:
    """A JSON file of a model folder; ModelLoadError naming it where it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelLoadError(f"{path}: not valid JSON ({type(error).__name__}: {error})") from None


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


def _layer_windows(architecture: str, config: dict[str, Any]) -> tuple[int | None, ...] | None:
    """Which layers slide, and by how much, as transformers' Mistral and Qwen2 / Qwen3 decide it
    (their config classes' defaults included: sliding_window 4096, max_window_layers 28); Llama
    has no window, whatever its config says."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window", 4096)
    if architecture == "MistralForCausalLM":
        return None if window is None else (window,) * num_layers
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


def _moe_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config's expert fields (checked by type and range already): the three sizes
    every such config.json states, the rest with transformers' defaults. The experts' count is
    num_experts in the released configs, num_local_experts where transformers 5 saved the config
    (its attribute_map's name for the same field)."""
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
        raise ValueError(f"hidden_act {activation!r} is not supported (Qwen3-MoE's experts: silu)")
    return {
        "num_experts": config["num_experts"],
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "norm_topk_prob": config.get("norm_topk_prob", False),
        "decoder_sparse_step": config.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(sorted(set(config.get("mlp_only_layers") or ()))),
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
