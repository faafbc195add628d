"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layers (model/qwen3.py: per-head query and
key norms) with a sparse mixture of experts in place of the dense MLP on the layers the config
names: layer i is sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
(the released models: every layer); the others keep a dense MLP of intermediate_size.

A sparse block routes each token to num_experts_per_tok of num_experts experts (softmax over the
router's logits in float32, top-k, renormalized where norm_topk_prob), each a SiLU-gated MLP of
moe_intermediate_size; layers/fused_moe.py computes them grouped by expert. A GGUF stores a
layer's experts as one 3-D tensor per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps),
read per expert in its blocks (model/gguf_weights.py).

With tensor parallelism each rank holds its share of the experts, whole (layers/fused_moe.py).
"""

from __future__ import annotations

from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.fused_moe import SparseMoeBlock
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.model.qwen3 import Qwen3DecoderLayer

__all__ = ["Qwen3MoeForCausalLM"]


def sparse_moe_block(config: ModelConfig, tp: TPGroup | None = None) -> SparseMoeBlock:
    """Qwen3-MoE's: experts of moe_intermediate_size, the top-k renormalized where norm_topk_prob,
    their weights in the hidden dtype."""
    assert config.num_experts and config.num_experts_per_tok and config.moe_intermediate_size
    return SparseMoeBlock(
        config.num_experts,
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        tp=tp,
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer, its MLP sparse where the config says (ModelConfig.is_sparse_layer)."""

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, index: int) -> nn.Module:
        return sparse_moe_block(config, tp) if config.is_sparse_layer(index) else LlamaMLP(config, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3MoeDecoderLayer
