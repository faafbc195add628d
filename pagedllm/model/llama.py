"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) over a flat, ragged token layout.

All tokens of a step, from all requests, are one [num_tokens, hidden_size] matrix: no padding,
no batch dimension. Only attention needs to know where one request ends and the next begins,
and it learns that from AttentionMetadata. Numerics follow Hugging Face's implementation
step by step (RMSNorm in float32, rotate-half RoPE) so float32 outputs match it: bit for bit in
PyTorch ops; on CPU, where the C++ passes and kernels sum in their own order, within a few float32
roundings, and greedy tokens the same (tests/model/test_correctness_hf.py). How each layer computes is
the layers' business (pagedllm/layers/), chosen once by `choose_impls`.

Tensor parallelism (`tp`: this rank's group, None for one rank): each rank owns num_heads / tp
and num_kv_heads / tp whole heads and intermediate_size / tp of the MLP; qkv_proj and
gate_up_proj are split by output rows, o_proj and down_proj by input columns (their outputs
summed over the ranks). Embeddings and norms are whole on every rank; the LM head is split by
vocabulary where the ranks divide it (layers/lm_head.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagedllm.attention.backend import Attention, CosSin, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import LinearBackend
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers import bind_attributes, choose_impls
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.lm_head import ParallelLMHead
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.config import ModelConfig

__all__ = ["KVCache", "LlamaForCausalLM"]


class LlamaAttention(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None, window: int | None = None) -> None:
        """`window`: the keys each query attends to, counted back from it (None: every key)."""
        super().__init__()
        tp_size = tp.world_size if tp is not None else 1
        num_heads = config.num_attention_heads // tp_size
        num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size = config.q_size // tp_size
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.q_size, config.kv_size, config.kv_size], config.attention_bias, tp
        )
        # rotary, the K/V write and paged attention: the step's backend (attention/backend.py)
        self.attn = Attention(num_heads, num_kv_heads, config.head_dim, config.attention_scale, window)
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, tp)

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        out = self.attn(qkv, rope, kv_cache, metadata)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(hidden.shape[0], self.q_size))


class LlamaMLP(DirectCall, nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup | None,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        """`intermediate_size`: a width other than the config's; `reduce_results` False: each
        rank's partial output, summed by the caller (Qwen2-MoE's shared expert)."""
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2, False, tp)
        self.act_fn: nn.Module = SiluAndMul()
        self.down_proj = RowParallelLinear(width, config.hidden_size, tp, reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(DirectCall, nn.Module):
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention
    """What a variant changes of the layer (Qwen3: per-head query and key norms, model/qwen3.py)."""

    def __init__(
        self, config: ModelConfig, tp: TPGroup | None, window: int | None = None, index: int = 0
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, tp, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, tp, index)

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, index: int) -> nn.Module:
        """The feed-forward block of layer `index` (Qwen3-MoE: experts where the config says)."""
        return LlamaMLP(config, tp)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(DirectCall, nn.Module):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    """Checkpoint projection -> (our fused projection, its index in it): pagedllm/model_loader.py's map."""
    decoder_layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    """The layer a variant builds on this model (Qwen3ForCausalLM: its own, model/qwen3.py)."""

    def __init__(self, config: ModelConfig, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling, config.rope_freq_factors
        )
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        windows = config.layer_windows or (None,) * config.num_hidden_layers
        self.layers = nn.ModuleList(
            self.decoder_layer_class(config, tp, window, index) for index, window in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.tie(self.embed_tokens.weight)

    def prepare(self, dtype: torch.dtype, linear_backend: LinearBackend = "auto") -> int:
        """Have every layer choose how it computes on this device and `dtype` (packing projection
        weights where that pays, quantized ones for the integer kernel); once, after loading.
        Returns the bytes this adds: a tied lm_head gets its own packed copy, since the embedding
        lookup needs the plain (or compact quantized) table. `linear_backend`: --linear-backend."""
        table = self.embed_tokens.quantized
        if self.config.tie_word_embeddings and table is not None:
            self.lm_head.tie_quantized(table)
        choose_impls(self, self.norm.weight.device, dtype, linear_backend)
        bind_attributes(self)
        return self.lm_head.packed_copy_bytes

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden_size],
        before the final norm (applied in compute_logits to the sampled rows only)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]; with a
        vocabulary-parallel head every rank calls it and rank 0 alone gets them (others: None)."""
        normed, _ = self.norm(hidden)
        return self.lm_head(normed)
