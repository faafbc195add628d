"""Qwen2-MoE (model/qwen2_moe.py) against transformers' Qwen2MoeForCausalLM on the same random
weights: routed experts beside a gated shared expert, bias on q/k/v, a dense layer among the
sparse ones; float32 greedy tokens and logprobs from the HF folder and from a qwen2moe GGUF in
llama.cpp's layout, the parameter counts, the config's bounds."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch

from pagedllm.layers.quantization import BlockQuantized
from pagedllm.model.config_reader import model_config_from_dict, model_config_from_folder
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.gguf_weights import iter_gguf_weights

from ..helpers import save_with_random_norms, write_tiny_gguf
from .moe_helpers import (
    assert_matches_transformers,
    eager_random_model,
    engine,
    moe_blocks,
    qwen2_moe_config,
    random_prompts,
)

ARCHITECTURE = "Qwen2MoeForCausalLM"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    model = eager_random_model(qwen2_moe_config())
    folder = tmp_path_factory.mktemp("qwen2moe")
    save_with_random_norms(model, folder)
    return model, folder


def test_greedy_and_logprobs_match_transformers(qwen2_moe):
    model, folder = qwen2_moe
    config = model_config_from_folder(folder)
    assert config.attention_bias and config.shared_expert_intermediate_size == 160
    assert [config.is_sparse_layer(i) for i in range(4)] == [True, True, False, True]
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    llm = engine(folder)
    assert len(moe_blocks(llm)) == 3
    assert_matches_transformers(model, llm, "qwen2-moe", random_prompts((5, 17, 33)), NEW_TOKENS)


def test_the_shared_expert_counts_as_active_and_quantizable(qwen2_moe):
    model, _ = qwen2_moe
    config = model_config_from_dict(qwen2_moe_config().to_dict())
    h, layers = config.hidden_size, model.config.num_hidden_layers
    routed_idle = 3 * (8 - 2) * 3 * h * 96  # 3 sparse layers, 6 of 8 experts idle a token
    assert config.active_parameters() == config.num_parameters() - routed_idle
    shared = 3 * 3 * h * 160  # every sparse layer's shared expert
    dense_mlp = 3 * h * config.intermediate_size
    attention = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    experts = 3 * 8 * 3 * h * 96
    assert config.projection_parameters() == layers * attention + dense_mlp + experts + shared


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ({"shared_expert_intermediate_size": 2**30}, "shared_expert_intermediate_size"),
        ({"qkv_bias": "yes"}, "qkv_bias"),
    ],
)
def test_a_config_out_of_bounds_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_dict(qwen2_moe_config().to_dict() | change)


QUANTIZED = (
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
)


def test_a_qwen2moe_gguf_matches_transformers_on_its_weights(qwen2_moe, tmp_path):
    """llama.cpp's layout: the experts stacked per projection, they and the shared expert in Q8_0,
    the shared expert's gate a vector; read as the HF folder's model (the experts kept in their
    blocks), then served dequantized and compared with transformers on the weights as written."""
    model, _ = qwen2_moe
    path = tmp_path / "tiny-qwen2moe.gguf"
    write_tiny_gguf(model, path, dict.fromkeys(QUANTIZED, gguf.GGMLQuantizationType.Q8_0))
    config = model_config_from_folder(converted_folder(path))
    assert config.architecture == ARCHITECTURE and config.shared_expert_intermediate_size == 160
    assert not config.norm_topk_prob and config.mlp_only_layers == (2,)
    ours = dict(iter_gguf_weights(path, config))
    as_float = {
        n: w.dequantize(torch.float32) if isinstance(w, BlockQuantized) else w for n, w in ours.items()
    }
    written = copy.deepcopy(model)
    params = dict(written.named_parameters())
    with torch.no_grad():
        for name, value in as_float.items():
            if name in params:  # the experts apart: transformers stacks them
                params[name].copy_(value)
        for i, layer in enumerate(written.model.layers):
            if not config.is_sparse_layer(i):
                continue
            for e in range(config.num_experts):
                gate, up, down = (
                    f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")
                )
                assert isinstance(ours[gate], BlockQuantized) and ours[gate].format == "Q8_0"
                layer.mlp.experts.gate_up_proj[e].copy_(torch.cat([as_float[gate], as_float[up]]))
                layer.mlp.experts.down_proj[e].copy_(as_float[down])
    assert ours["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, config.hidden_size)
    llm = engine(path)
    assert len(moe_blocks(llm)) == 3
    assert_matches_transformers(written, llm, "qwen2moe GGUF", random_prompts((5, 17)), NEW_TOKENS)
