"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layers (model/qwen3.py: per-head query and
key norms) with a sparse mixture of experts in place of the dense MLP on the layers the config
names: layer i is sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
(the released models: every layer); the others keep a dense MLP of intermediate_size.

A sparse block routes each token to num_experts_per_tok of num_experts experts (softmax over the
router's logits in float32, top-k, renormalized where norm_topk_prob), each a SiLU-gated MLP of
moe_intermediate_size; layers/fused_moe.py computes them grouped by expert. A GGUF stores a
layer's experts as one 3-D tensor per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps),
read per expert in its blocks (model/gguf_weights.py).

Tensor parallelism is not offered yet: the experts would have to be split over the ranks
(ModelConfig.check_tensor_parallel_size refuses it first).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import CosSin, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.fused_moe import FusedMoE, Router, select_experts
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.lm_head import ParallelLMHead
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.model.qwen3 import Qwen3Attention

__all__ = ["Qwen3MoeForCausalLM"]


class Qwen3MoeSparseMoeBlock(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.num_experts and config.num_experts_per_tok and config.moe_intermediate_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(config.num_experts, config.hidden_size)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, self.norm_topk_prob)
        return self.experts(hidden, topk_weights, topk_ids)


class Qwen3MoeDecoderLayer(DirectCall, nn.Module):
    """Qwen3's layer, its MLP sparse where `is_sparse`."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None, window: int | None, is_sparse: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, tp, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: Qwen3MoeSparseMoeBlock | LlamaMLP = (
            Qwen3MoeSparseMoeBlock(config) if is_sparse else LlamaMLP(config, tp)
        )

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


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_position: int, tp: TPGroup | None = None) -> None:
        if tp is not None and tp.world_size > 1:
            raise ValueError(f"{config.architecture} runs on one rank: its experts are not split over ranks")
        nn.Module.__init__(self)
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling, config.rope_freq_factors
        )
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        windows = config.layer_windows or (None,) * config.num_hidden_layers
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, tp, window, config.is_sparse_layer(index))
            for index, window in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()
