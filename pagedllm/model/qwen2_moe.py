"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's layers (model/llama.py with bias on the
query, key and value projections) with a sparse mixture of experts on the layers the config names
(as Qwen3-MoE's rule: model/qwen3_moe.py), and beside the routed experts a shared one: a dense
SiLU-gated MLP of shared_expert_intermediate_size that every token takes, its output scaled by
sigmoid of a one-output gate (shared_expert_gate), then added to the routed experts' sum, as
transformers' Qwen2MoeSparseMoeBlock adds it.

The routed experts are Qwen3-MoE's (softmax in float32, top-k, renormalized where norm_topk_prob:
the released models do not), grouped by expert in layers/fused_moe.py. The shared expert is a
projection pair like a dense MLP's (kept as stored, quantized or float); its gate stays float, as
the router does. A qwen2moe GGUF stores the routed experts stacked as Qwen3-MoE's, the shared
expert as ffn_gate/up/down_shexp and its gate as a vector (ffn_gate_inp_shexp, read as one row);
llama.cpp's graph does not renormalize the top-k (model/gguf_metadata.py).

With tensor parallelism each rank holds its share of the routed experts (layers/fused_moe.py) and
of the shared expert's width, as a dense MLP's; the two partial outputs are summed over the ranks
together, once a layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.fused_moe import Router, SparseMoeBlock
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

__all__ = ["Qwen2MoeForCausalLM"]


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """The routed experts and the shared expert, its output gated per token."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None) -> None:
        assert config.num_experts and config.num_experts_per_tok and config.moe_intermediate_size
        assert config.shared_expert_intermediate_size
        super().__init__(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            tp=tp,
        )
        width = config.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(config, tp, width, reduce_results=False)
        self.shared_expert_gate = Router(1, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> the routed experts' sum plus the gated shared expert."""
        shared = self.shared_expert(hidden)
        routed = self.routed(hidden)
        return self.reduce(routed + torch.sigmoid(self.shared_expert_gate(hidden)) * shared)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    """Qwen2's layer, its MLP sparse where the config says (ModelConfig.is_sparse_layer)."""

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, index: int) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(config, tp) if config.is_sparse_layer(index) else LlamaMLP(config, tp)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen2MoeDecoderLayer
