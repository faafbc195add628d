"""Gemma 3 (text; Gemma3ForCausalLM, the 1B's architecture): the Llama layout with Gemma's changes.

- Every RMSNorm scales by 1 + weight; the checkpoint's weight is loaded as 1 + weight (summed in
  float32, as Hugging Face sums it), so the shared norm paths compute it.
- Four norms a layer: the attention's and the MLP's outputs are normed before the residual add
  (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by its own
  (pre_feedforward_layernorm).
- Queries and keys normed per head (as Qwen3), scores scaled by query_pre_attn_scalar ** -0.5.
- Five of six layers attend a sliding window of the last `sliding_window` keys, with their own
  rope base (local_rope_theta, unscaled); the others every key, with rope_theta and its scaling.
  The window is applied in attention; the cache keeps every block of a request.
- The embedding is scaled by sqrt(hidden_size), rounded to the model's dtype as Hugging Face does.
- The MLP's activation is GELU (tanh approximation) of the gate times up.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import CosSin, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import LinearBackend
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.activation import GeluTanhAndMul
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import Loaded, copy_weight
from pagedllm.layers.lm_head import ParallelLMHead
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.model.qwen3 import Qwen3Attention

__all__ = ["Gemma3ForCausalLM"]


class GemmaRMSNorm(RMSNorm):
    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        assert isinstance(loaded, torch.Tensor)
        copy_weight(param.data, loaded.float() + 1.0)


class Gemma3Attention(Qwen3Attention):
    head_norm_class = GemmaRMSNorm


class Gemma3MLP(LlamaMLP):
    def __init__(self, config: ModelConfig, tp: TPGroup | None) -> None:
        super().__init__(config, tp)
        self.act_fn = GeluTanhAndMul()


class Gemma3DecoderLayer(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None, window: int | None) -> None:
        super().__init__()
        self.is_sliding = window is not None
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Gemma3Attention(config, tp, window)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Gemma3MLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> the same pair after the layer: the stream is residual + hidden."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_position: int, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        assert config.layer_windows is not None and config.local_rope_theta is not None
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, max_position, config.local_rope_theta)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, tp, window) for window in config.layer_windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()
        self.embed_scale = torch.tensor(config.hidden_size**0.5)  # rounded to the dtype in prepare

    def prepare(self, dtype: torch.dtype, linear_backend: LinearBackend = "auto") -> int:
        # sqrt(hidden_size) in float32, then in the model's dtype, as transformers rounds it
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5).to(dtype)
        return super().prepare(dtype, linear_backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        global_rope, local_rope = self.rotary(positions), self.local_rotary(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            rope = local_rope if layer.is_sliding else global_rope
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return hidden + residual
