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

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.fused_moe import FusedMoE, Router, select_experts
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.model.qwen3 import Qwen3DecoderLayer

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


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer, its MLP sparse where the config says (ModelConfig.is_sparse_layer)."""

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, index: int) -> nn.Module:
        return Qwen3MoeSparseMoeBlock(config) if config.is_sparse_layer(index) else LlamaMLP(config, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3MoeDecoderLayer

    def __init__(self, config: ModelConfig, max_position: int, tp: TPGroup | None = None) -> None:
        if tp is not None and tp.world_size > 1:
            raise ValueError(f"{config.architecture} runs on one rank: its experts are not split over ranks")
        super().__init__(config, max_position, tp)
