"""Qwen3 (dense): the Llama architecture plus an RMSNorm over head_dim on every query and key head
(`q_norm`, `k_norm`), applied before rotary. Everything else is model/llama.py's; `head_dim` comes
from the config and need not be hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 heads,
head_dim 128), and qkv has no bias unless the config's `attention_bias` says so.

Rotary and the K/V write happen inside the attention backend, on the fused qkv projection, so the
norms are applied to its query and key parts first and a new qkv goes to attention. The norms'
weights are [head_dim], whole on every tensor-parallel rank, like the other norms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.attention.backend import CosSin, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import cpu_ops
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3Attention(LlamaAttention):
    head_norm_class: type[RMSNorm] = RMSNorm
    """The per-head norms' kind (Gemma 3's scale by 1 + weight: model/gemma3.py)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None, window: int | None = None) -> None:
        super().__init__(config, tp, window)
        tp_size = tp.world_size if tp is not None else 1
        self.kv_size = config.kv_size // tp_size
        self.head_dim = config.head_dim
        self.q_norm = self.head_norm_class(config.head_dim, config.rms_norm_eps)
        self.k_norm = self.head_norm_class(config.head_dim, config.rms_norm_eps)
        self.norm_heads: Callable[[torch.Tensor], torch.Tensor] = self._norm_heads_apart

    def choose_impl(self, device: torch.device, dtype: torch.dtype) -> None:
        """On CPU, the heads normed in place in one C++ pass (the same bits as the norms' own)."""
        if cpu_ops.serves_layer_ops(device, dtype):
            self.norm_heads = self._norm_heads_in_place

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.norm_heads(self.qkv_proj(hidden))  # [num_tokens, q_size + 2 * kv_size]
        out = self.attn(qkv, rope, kv_cache, metadata)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(hidden.shape[0], self.q_size))

    def _norm_heads_apart(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each query and key head normed over its head_dim, in PyTorch ops: a new qkv."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        normed_q, _ = self.q_norm(q.reshape(-1, self.head_dim))  # [num_tokens * heads, head_dim]
        normed_k, _ = self.k_norm(k.reshape(-1, self.head_dim))
        return torch.cat([normed_q.view(q.shape), normed_k.view(k.shape), v], dim=-1)

    def _norm_heads_in_place(self, qkv: torch.Tensor) -> torch.Tensor:
        qkv = qkv.contiguous()
        num_heads, num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        return cpu_ops.rms_norm_heads_(
            qkv, self.q_norm.weight, self.k_norm.weight, num_heads, num_kv_heads, self.q_norm.eps
        )


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
