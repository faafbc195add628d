"""Qwen3 (dense): the Llama architecture plus an RMSNorm over head_dim on every query and key head
(`q_norm`, `k_norm`), applied before rotary. Everything else is model/llama.py's; `head_dim` comes
from the config and need not be hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 heads,
head_dim 128), and qkv has no bias unless the config's `attention_bias` says so.

Rotary and the K/V write happen inside the attention backend, on the fused qkv projection, so the
norms are applied to its query and key parts first and a new qkv goes to attention. The norms'
weights are [head_dim], whole on every tensor-parallel rank, like the other norms.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import CosSin, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3Attention(LlamaAttention):
    head_norm_class: type[RMSNorm] = RMSNorm
    """The per-head norms' kind (Gemma 3's scale by 1 + weight: model/gemma3.py)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None) -> None:
        super().__init__(config, tp)
        tp_size = tp.world_size if tp is not None else 1
        self.kv_size = config.kv_size // tp_size
        self.head_dim = config.head_dim
        self.q_norm = self.head_norm_class(config.head_dim, config.rms_norm_eps)
        self.k_norm = self.head_norm_class(config.head_dim, config.rms_norm_eps)

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qkv = torch.cat([self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k), v], dim=-1)
        out = self.attn(qkv, rope, kv_cache, metadata)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(hidden.shape[0], self.q_size))

    def _norm_heads(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads * head_dim], each head normed over its head_dim; same shape."""
        normed, _ = norm(x.reshape(-1, self.head_dim))  # [num_tokens * heads, head_dim]
        return normed.view(x.shape)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
