"""Mixtral (Mixtral-8x7B, 8x22B): Llama's layers (model/llama.py: no query or key norms) with every
layer's MLP a sparse mixture of experts: num_local_experts SiLU-gated experts of intermediate_size,
each token routed to num_experts_per_tok of them (two in the released models).

The router is Mixtral's rule, as transformers' MixtralTopKRouter computes it: softmax over the
logits in float32, top-k, the k weights always renormalized to sum to 1 and kept in float32 (Qwen3-MoE
renormalizes where its config says and casts them to the hidden dtype). The experts are
layers/fused_moe.py's, grouped by expert. Every layer slides over sliding_window keys where the
config sets one (the released 8x7B's is null), as transformers' Mixtral attention does.

Checkpoints name the block block_sparse_moe and its experts' projections w1 (gate), w3 (up), w2
(down); model/registry.py's row renames them to mlp.gate and mlp.experts.E.gate_proj / up_proj /
down_proj, transformers 5's names, which this model's modules take. llama.cpp writes Mixtral as a
"llama" GGUF with experts (model/gguf_metadata.py reads it as this model), its experts stacked one
3-D tensor per projection and read per expert in their blocks (model/gguf_weights.py).

With tensor parallelism each rank holds its share of the experts, whole (layers/fused_moe.py).
"""

from __future__ import annotations

from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.fused_moe import SparseMoeBlock
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["MixtralForCausalLM"]


def sparse_moe_block(config: ModelConfig, tp: TPGroup | None = None) -> SparseMoeBlock:
    """Mixtral's: experts of intermediate_size, the top-k always renormalized, their weights kept
    in float32."""
    assert config.num_experts and config.num_experts_per_tok  # model/config_reader.py sets them
    return SparseMoeBlock(
        config.num_experts,
        config.hidden_size,
        config.intermediate_size,
        config.num_experts_per_tok,
        renormalize=True,
        float32_weights=True,
        tp=tp,
    )


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the sparse block in place of its MLP, on every layer."""

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, index: int) -> nn.Module:
        return sparse_moe_block(config, tp)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer_class = MixtralDecoderLayer
