"""ModelConfig: the shape of a Llama-family, Gemma 3, Qwen3-MoE or Mixtral model, as data, and what
follows from it (the projections' sizes, the parameters, which tensor-parallel sizes split it, the
context).

Names are Hugging Face's config.json's, so a config and its weights map one to one. A ModelConfig
is made by model/config_reader.py, which reads config.json (or a GGUF's metadata, translated into
the same form by gguf_metadata.py) and checks every field before it sizes anything; this module
imports nothing of pagedllm, so every model file, checker and reader can import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


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
    below are set together with it, as transformers' Qwen3MoeConfig names them (a Mixtral config's
    are read into the same fields: model/config_reader.py)."""
    num_experts_per_tok: int | None = None
    """The experts each token is routed to (top-k of the router's softmax)."""
    moe_intermediate_size: int | None = None
    """Each expert's gated MLP width (the dense layers' is intermediate_size; Mixtral's experts are
    of intermediate_size, and all its layers sparse)."""
    norm_topk_prob: bool = False
    """The chosen experts' weights renormalized to sum to 1."""
    decoder_sparse_step: int = 1
    """Every this-many-th layer is sparse (layer i where (i + 1) % step == 0) ..."""
    mlp_only_layers: tuple[int, ...] = ()
    """... except these, which keep the dense MLP."""
    shared_expert_intermediate_size: int | None = None
    """Qwen2-MoE: the width of the dense expert every token of a sparse layer takes beside its
    routed ones (its output scaled by a one-output gate); None: no shared expert."""

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

    def _shared_expert_parameters(self) -> tuple[int, int]:
        """A sparse layer's shared expert's (projections, gate) parameters; none without one."""
        width = self.shared_expert_intermediate_size or 0
        return 3 * self.hidden_size * width, self.hidden_size if width else 0

    @property
    def attention_scale(self) -> float:
        """What scores are scaled by: query_pre_attn_scalar ** -0.5 where the model sets it (Gemma),
        else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_parameters(self, tp_size: int = 1) -> int:
        """Parameter count from the shapes alone (for planning without weights); with tensor
        parallelism one rank's: the layers' projections split (a sparse layer's experts by expert,
        its shared expert by width), embeddings, norms and routers whole, an untied LM head split
        where the ranks divide the vocabulary (a tied one is the embedding)."""
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
        if self.num_experts is not None:  # experts, router and gate in place of the dense MLP
            (routed, router), (shared, gate) = self._experts_parameters(), self._shared_expert_parameters()
            sparse = (routed + shared) // tp_size + router + gate  # experts split, gates whole
            experts = self.num_sparse_layers * (sparse - 3 * h * i // tp_size)
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
            shared = self._shared_expert_parameters()[0]
            experts = self.num_sparse_layers * (self._experts_parameters()[0] + shared - mlp)
        return (self.num_hidden_layers * per_layer + experts) // tp_size

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """Raise ValueError, naming the sizes that work, unless every rank gets whole heads (and of
        a mixture of experts, as many experts as the others, and its share of a shared expert)."""
        counts = {
            "attention heads": self.num_attention_heads,
            "KV heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
        }
        if self.num_experts is not None:
            counts["experts"] = self.num_experts
        if self.shared_expert_intermediate_size:
            counts["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
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
