"""Mixtral (model/mixtral.py) against transformers' MixtralForCausalLM on the same random weights:
HF folders (the released checkpoints' block_sparse_moe.experts.E.w1/w2/w3, as save_pretrained
writes them, and transformers' own stacked layout), "llama" GGUFs with experts as llama.cpp writes
Mixtral (float32, float16 and Q8_0 experts), a sliding window, every expert chosen, the parameters
`pagedllm plan` counts for Mixtral-8x7B, and the configs refused."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization import BlockQuantized
from pagedllm.model.config_reader import model_config_from_dict, model_config_from_folder
from pagedllm.model.errors import ModelLoadError
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.gguf_file import read_gguf
from pagedllm.model.gguf_weights import iter_gguf_weights

from ..helpers import (
    TINY,
    hf_greedy,
    save_with_random_norms,
    write_tiny_gguf,
)
from .moe_helpers import (
    assert_matches_transformers,
    eager_random_model,
    engine,
    moe_blocks,
    one_thread,
    random_prompts,
)

KIND = gguf.GGMLQuantizationType
ARCHITECTURE = "MixtralForCausalLM"
NUM_EXPERTS = 4
NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 17, 33)  # over the 16-token budget below: chunked prefill


def mixtral_config(**overrides):
    """2 layers, each 4 experts of width 96 (intermediate_size: not the hidden size, so a projection
    read across shows), top-2, no sliding window (the released 8x7B's null)."""
    from transformers import MixtralConfig

    fields = TINY | {
        "intermediate_size": 96,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "architectures": [ARCHITECTURE],
    }
    return MixtralConfig(**(fields | overrides))


def random_model(**overrides):
    return eager_random_model(mixtral_config(**overrides))


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def tensor_names(folder) -> set[str]:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as file:
        return set(file.keys())


# ---- HF folders ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral_model():
    return random_model()


@pytest.fixture(scope="module")
def mixtral_folder(mixtral_model, tmp_path_factory):
    """mixtral_config()'s random model saved as save_pretrained writes it: the released names."""
    folder = tmp_path_factory.mktemp("mixtral")
    save_with_random_norms(mixtral_model, folder)
    return folder


def test_released_names_load_and_match_transformers(mixtral_model, mixtral_folder):
    """The names of Mixtral-8x7B's files (block_sparse_moe.gate, block_sparse_moe.experts.E.w1 /
    w3 / w2), which save_pretrained restores: every layer sparse, its experts of intermediate_size,
    their weights renormalized; tokens and logprobs as transformers'."""
    names = tensor_names(mixtral_folder)
    for name in ("gate", "experts.3.w1", "experts.3.w2", "experts.3.w3"):
        assert f"model.layers.1.block_sparse_moe.{name}.weight" in names
    assert not any(".mlp." in name for name in names)
    config = model_config_from_folder(mixtral_folder)
    assert config.architecture == ARCHITECTURE and config.layer_windows is None
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 96)
    assert config.norm_topk_prob and config.num_sparse_layers == 2
    assert config.num_parameters() == sum(p.numel() for p in mixtral_model.parameters())
    llm = engine(mixtral_folder)
    assert len(moe_blocks(llm)) == 2
    assert_matches_transformers(mixtral_model, llm, "released names", prompts()[:2], NEW_TOKENS)


def test_transformers_stacked_experts_load(tmp_path):
    """transformers 5's own layout (save_original_format=False): mlp.gate and the experts stacked,
    mlp.experts.gate_up_proj [experts, 2 x width, hidden]."""
    model = save_with_random_norms(random_model(), tmp_path)
    model.save_pretrained(tmp_path, save_original_format=False)
    names = tensor_names(tmp_path)
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= names
    assert_matches_transformers(model, engine(tmp_path), "stacked experts", prompts()[:1], NEW_TOKENS)


def test_a_sliding_window_slides_every_layer(tmp_path):
    """sliding_window set (Mixtral's config allows one): transformers' Mixtral slides every layer;
    a 33-token prompt runs past the 8-key window."""
    model = random_model(sliding_window=8)
    save_with_random_norms(model, tmp_path)
    assert model_config_from_folder(tmp_path).layer_windows == (8, 8)
    assert_matches_transformers(model, engine(tmp_path), "sliding window", prompts()[2:], NEW_TOKENS)


def test_every_expert_chosen_when_top_k_is_all_of_them(tmp_path):
    """num_experts_per_tok = num_local_experts: each token's output is all experts', weighted by
    the whole softmax (renormalized: unchanged)."""
    model = random_model(num_experts_per_tok=NUM_EXPERTS)
    save_with_random_norms(model, tmp_path)
    assert model_config_from_folder(tmp_path).num_experts_per_tok == NUM_EXPERTS
    assert_matches_transformers(model, engine(tmp_path), "top-k all", prompts()[1:2], NEW_TOKENS)


def test_an_expert_beyond_the_config_is_refused(mixtral_folder, tmp_path):
    """The released names reach the tensor checks renamed: a file holding 4 experts a layer
    beside a config of 2 is refused before any weight is read, naming the file's own tensor."""
    for file in mixtral_folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_local_experts": 2}))
    with pytest.raises(ModelLoadError, match=r"block_sparse_moe\.experts\.2\.w\d\.weight' is of expert 2"):
        model_config_from_folder(tmp_path)


# ---- GGUF: llama.cpp's Mixtral, a "llama" file with experts --------------------------------------


def as_written(model, qtype):
    """`model` with each expert's weights as `qtype` holds them: quantized and dequantized by the
    `gguf` package, as write_tiny_gguf writes them (gate and up apart, as the file stacks them)."""

    def round_trip(weights: torch.Tensor) -> torch.Tensor:
        if qtype == KIND.F32:
            return weights
        if qtype == KIND.F16:
            return weights.half().float()
        blocks = gguf.quants.quantize(weights.contiguous().numpy(), qtype)
        return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))

    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            gate, up = experts.gate_up_proj.chunk(2, dim=1)
            experts.gate_up_proj.copy_(torch.cat([round_trip(gate), round_trip(up)], dim=1))
            experts.down_proj.copy_(round_trip(experts.down_proj))
    return model


@pytest.fixture(
    scope="module",
    params=[  # make test-fast keeps Q8_0: experts kept in blocks for the integer kernel
        pytest.param(KIND.F32, marks=pytest.mark.slow),
        pytest.param(KIND.F16, marks=pytest.mark.slow),
        KIND.Q8_0,
    ],
    ids=lambda kind: kind.name,
)
def mixtral_gguf(request, tmp_path_factory):
    """(transformers on the file's experts as written, the GGUF path, the experts' format): the
    random model as a "llama" GGUF with an expert count, its experts in `param`, the rest float32."""
    folder = tmp_path_factory.mktemp("gguf")
    model = save_with_random_norms(random_model(), folder / "hf")
    qtype = request.param
    path = folder / "tiny-mixtral.gguf"
    write_tiny_gguf(model, path, {"ffn_gate_exps": qtype, "ffn_up_exps": qtype, "ffn_down_exps": qtype})
    return as_written(model, qtype), path, qtype


def test_a_llama_gguf_with_experts_reads_as_mixtral(mixtral_gguf):
    """general.architecture llama with llama.expert_count: Mixtral, its experts of
    feed_forward_length; Q and K un-permuted as for Llama; each expert's slice of the stacked
    tensors exactly what was written, kept in its blocks where quantized."""
    model, path, qtype = mixtral_gguf
    assert read_gguf(path).metadata["general.architecture"] == "llama"
    config = model_config_from_folder(converted_folder(path))
    assert config.architecture == ARCHITECTURE
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 96)
    assert config.norm_topk_prob and config.num_sparse_layers == 2
    ours = dict(iter_gguf_weights(path, config))
    state = model.state_dict()
    assert set(ours) == {name for name in state if ".experts." not in name} | {
        f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
        for layer in range(2)
        for expert in range(NUM_EXPERTS)
        for projection in ("gate_proj", "up_proj", "down_proj")
    }
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for projection in ("q_proj", "k_proj"):
            name = f"{prefix}.self_attn.{projection}.weight"
            assert torch.equal(ours[name], state[name])
        for expert in range(NUM_EXPERTS):
            gate, up = state[f"{prefix}.mlp.experts.gate_up_proj"][expert].chunk(2)
            down = state[f"{prefix}.mlp.experts.down_proj"][expert]
            for projection, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                read = ours[f"{prefix}.mlp.experts.{expert}.{projection}.weight"]
                if qtype == KIND.Q8_0:
                    assert isinstance(read, BlockQuantized) and read.format == "Q8_0"
                    read = read.dequantize()
                assert torch.equal(read, weight), (layer, expert, projection)


def test_gguf_matches_transformers(mixtral_gguf):
    """--quantization none: the experts as float32 (Q8_0's dequantized), tokens and logprobs as
    transformers' on the same weights."""
    model, path, qtype = mixtral_gguf
    assert_matches_transformers(model, engine(path), f"{qtype.name} GGUF", prompts()[:2], NEW_TOKENS)


@pytest.mark.skipif(not cpu_ops.serves_quant_linear(4, 64, 64), reason="no integer kernel on this build")
@pytest.mark.parametrize("mixtral_gguf", [KIND.Q8_0], ids=["Q8_0"], indirect=True)
def test_gguf_experts_kept_in_their_blocks(mixtral_gguf):
    """Without --quantization the Q8_0 experts stay in the file's blocks, computed by the integer
    kernel, which rounds its inputs to 8 bits per block of 32 (test_qwen3_moe.py measures that
    rounding apart). Scored teacher-forced on transformers' greedy tokens (its weights the file's,
    dequantized): here (AVX-512, 12 tokens) mean |logprob difference| 0.04, max 0.10; asked under
    0.25, as test_qwen3_moe.py asks of its experts against plain transformers."""
    model, path, _ = mixtral_gguf
    llm = engine(path, quantization=None)
    for block in moe_blocks(llm):
        for expert in block.expert_mlps:
            assert expert.gate_up_proj.weight_format == expert.down_proj.weight_format == "Q8_0"
    ids = prompts()[1]
    with one_thread():
        tokens, _ = hf_greedy(model, ids, NEW_TOKENS)
        sequence = ids + tokens
        with torch.inference_mode():
            reference = torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), -1)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    output = llm.generate({"prompt_token_ids": sequence}, params, use_tqdm=False)[0]
    differences = [
        abs(output.prompt_logprobs[position][token].logprob - float(reference[position - 1, token]))
        for position, token in enumerate(sequence[len(ids) :], start=len(ids))
    ]
    assert sum(differences) / len(differences) < 0.25, differences


# ---- configs: what a plan counts, what is refused ------------------------------------------------


def test_plan_counts_mixtral_8x7b_total_and_active_parameters(tmp_path, capsys):
    """Mixtral-8x7B's config.json: `pagedllm plan` counts transformers' parameters (its model built
    on the meta device: 46.7B), and those a token uses (2 of 8 experts on each of 32 layers: 12.9B)."""
    from transformers import AutoModelForCausalLM

    from pagedllm.entrypoints.cli.main import main

    hf_config = mixtral_config(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        sliding_window=None,
    )
    hf_config.save_pretrained(tmp_path)
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    active = total - 32 * (8 - 2) * 3 * 4096 * 14336
    assert (total, active) == (46_702_792_704, 12_879_925_248)

    argv = ["plan", "--model", str(tmp_path), "--dtype", "bfloat16", "--kv-cache-memory-bytes", "1GiB"]
    main([*argv, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert (plan["num_parameters"], plan["active_parameters_per_token"]) == (total, active)
    main(argv)
    assert f"active           {active:,} parameters a token (2 of 8 experts on 32 of 32 layers" in (
        capsys.readouterr().out
    )


def test_what_a_mixtral_config_leaves_out_is_transformers_default():
    """No expert counts: transformers' 8 experts, top-2; no sliding_window: none (MixtralConfig's,
    not Mistral's 4,096); Qwen3-MoE's fields, which Mixtral has not, are ignored as transformers
    ignores them."""
    config = mixtral_config().to_dict()
    for name in ("num_local_experts", "num_experts_per_tok", "sliding_window"):
        del config[name]
    config |= {"moe_intermediate_size": 7, "mlp_only_layers": [0], "norm_topk_prob": False}
    ours = model_config_from_dict(config)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (8, 2, 96)
    assert ours.norm_topk_prob and ours.num_sparse_layers == 2 and ours.layer_windows is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than num_experts 4"),
        ({"num_local_experts": 0}, "num_local_experts 0 is not an integer in"),
        ({"num_local_experts": 4096, "num_hidden_layers": 64}, "262,144 experts, more than any model"),
        ({"num_experts": 8}, "num_experts 8 and num_local_experts 4 disagree"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_a_config_out_of_bounds_is_refused(change, message):
    config = mixtral_config().to_dict() | change
    with pytest.raises(ModelLoadError, match=message):
        model_config_from_dict(config, source="config.json")


def test_tensor_parallel_sizes_must_divide_the_experts():
    config = model_config_from_dict(mixtral_config(num_local_experts=5).to_dict())
    config.check_tensor_parallel_size(1)
    with pytest.raises(ValueError, match=r"2 does not divide this model's 5 experts.*: 1$"):
        config.check_tensor_parallel_size(2)
    model_config_from_dict(mixtral_config(num_local_experts=6).to_dict()).check_tensor_parallel_size(2)
