"""Qwen3-MoE (model/qwen3_moe.py, layers/fused_moe.py) against transformers' Qwen3MoeForCausalLM on
the same random weights: HF folders (per-expert tensors as save_pretrained writes them, and
transformers' own stacked layout), GGUFs with the experts stacked and quantized as llama.cpp stores
them, prefix caching and an int8 KV cache against the plain path, the routing edge cases on the
block alone, the sparse layers and parameter counts against transformers' model, and the configs
refused, and `eval weight-quant` over quantized experts."""

from __future__ import annotations

import json
import math
import re

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.fused_moe import select_experts
from pagedllm.layers.quantization import BlockQuantized
from pagedllm.model.config_reader import model_config_from_dict, model_config_from_folder
from pagedllm.model.errors import ModelLoadError
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.gguf_file import GGUFTensor
from pagedllm.model.gguf_weights import _experts_apart as gguf_experts_apart
from pagedllm.model.gguf_weights import held_form, iter_gguf_weights, read_tensor
from pagedllm.model.qwen3_moe import sparse_moe_block
from pagedllm.planner import gguf_weights_by_format
from pagedllm.sampling_params import StructuredOutputsParams

from ..helpers import (
    hf_greedy,
    random_gguf_blocks,
    rows_free,
    save_with_random_norms,
    write_tiny_gguf,
)
from .moe_helpers import eager_random_model, engine, moe_blocks, moe_config, one_thread, random_prompts

KIND = gguf.GGMLQuantizationType
ARCHITECTURE = "Qwen3MoeForCausalLM"
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 17, 33, 40)  # over the 16-token budget below: chunked prefill


def random_model(**overrides):
    return eager_random_model(moe_config(**overrides))


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


@torch.inference_mode()
def reference(model, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for `ids` alone, and each step's log-softmax."""
    with one_thread():
        tokens, logits = hf_greedy(model, ids, NEW_TOKENS)
    return tokens, [torch.log_softmax(step, -1) for step in logits]


@torch.inference_mode()
def teacher_forced(model, sequence: list[int]) -> torch.Tensor:
    """transformers' log-softmax after each token of `sequence`, [len(sequence), vocab]."""
    with one_thread():
        return torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), -1)


def generate_all(llm: LLM, prompt_ids: list[list[int]]):
    """All prompts in one call (batched, their prefills chunked), greedy, with logprobs."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def assert_matches_reference(model, llm: LLM, label: str) -> float:
    """pagedllm's greedy tokens equal transformers' (up to a near tie of the reference, after which
    the runs may part), each token's logprob within 1e-4 of transformers'. Returns the largest
    |logprob difference| seen."""
    worst = 0.0
    prompt_ids = prompts()
    for ids, ours in zip(prompt_ids, generate_all(llm, prompt_ids), strict=True):
        ref_tokens, ref_logprobs = reference(model, ids)
        for step, (a, b) in enumerate(zip(ours.token_ids, ref_tokens, strict=True)):
            if a != b:
                top2 = ref_logprobs[step].topk(2).values
                assert float(top2[0] - top2[1]) < 1e-3, f"{label}: step {step}: {a} != {b} away from a tie"
                break
            difference = abs(ours.logprobs[step][a].logprob - float(ref_logprobs[step][a]))
            assert difference < 1e-4, f"{label}: prompt of {len(ids)}, step {step}: {difference:.2e}"
            worst = max(worst, difference)
    return worst


# ---- HF folders ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("norm_topk_prob", "original_format"),
    [  # make test-fast: stacked experts renormalize; the released layout does not
        pytest.param(True, True, marks=pytest.mark.slow),
        (False, True),
        (True, False),
    ],
    ids=["renormalized", "not-renormalized", "stacked-experts"],
)
def test_greedy_and_logprobs_match_transformers(norm_topk_prob, original_format, tmp_path):
    """Float32, several prompts at once with chunked prefill: tokens and logprobs as transformers'.
    Saved as save_pretrained writes it (each expert's gate/up/down_proj), or in transformers' own
    stacked layout (experts.gate_up_proj [experts, 2 x width, hidden])."""
    model = random_model(norm_topk_prob=norm_topk_prob)
    save_with_random_norms(model, tmp_path)
    if not original_format:
        model.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as file:
        names = set(file.keys())
    stacked = "model.layers.0.mlp.experts.gate_up_proj" in names
    assert stacked != original_format and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer

    config = model_config_from_folder(tmp_path)
    assert [config.is_sparse_layer(i) for i in range(4)] == [True, False, True, True]
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    llm = engine(tmp_path)
    assert len(moe_blocks(llm)) == 3
    assert_matches_reference(model, llm, f"norm_topk_prob={norm_topk_prob}")


def test_a_sliding_window_slides_every_layer(tmp_path):
    """use_sliding_window: transformers' Qwen3-MoE slides every layer (no max_window_layers)."""
    model = random_model(use_sliding_window=True, sliding_window=8)
    save_with_random_norms(model, tmp_path)
    assert model_config_from_folder(tmp_path).layer_windows == (8, 8, 8, 8)
    assert_matches_reference(model, engine(tmp_path), "sliding window")


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """moe_config()'s random model saved as save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("moe")
    save_with_random_norms(random_model(), folder)
    return folder


@pytest.fixture(scope="module")
def moe_llm(moe_folder) -> LLM:
    return engine(moe_folder)


def score(llm: LLM, sequences: list[list[int]], starts: list[int]) -> list[tuple[float, bool]]:
    """Each token of `sequences` from its start on, scored by `llm` as a prompt (teacher-forced):
    (its logprob, whether it was the engine's first choice there)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    scores = []
    for output, sequence, start in zip(outputs, sequences, starts, strict=True):
        for position in range(start, len(sequence)):
            entry = output.prompt_logprobs[position]
            token = sequence[position]
            scores.append((entry[token].logprob, token == max(entry, key=lambda t: entry[t].logprob)))
    return scores


def test_prefix_caching_gives_the_plain_path_tokens(moe_folder, moe_llm):
    """Two requests sharing a 40-token prefix, one after the other: the second reads the first's
    two whole blocks from the cache and computes only the rest (its experts chosen for those rows
    alone); the tokens and logprobs are those of an engine without prefix caching."""
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(100, 49000, (40,), generator=generator).tolist()
    prompt_ids = [prefix + torch.randint(100, 49000, (n,), generator=generator).tolist() for n in (5, 9)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)

    def one_by_one(llm: LLM):
        return [llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for ids in prompt_ids]

    moe_llm.reset_prefix_cache()
    cached = one_by_one(moe_llm)
    plain = one_by_one(engine(moe_folder, enable_prefix_caching=False))
    assert [o.num_cached_tokens for o in cached] == [0, 32]
    assert [o.num_cached_tokens for o in plain] == [0, 0]
    for ours, theirs in zip(cached, plain, strict=True):
        tokens = ours.outputs[0].token_ids
        assert tokens == theirs.outputs[0].token_ids
        for step, token in enumerate(tokens):
            a, b = ours.outputs[0].logprobs[step][token], theirs.outputs[0].logprobs[step][token]
            assert abs(a.logprob - b.logprob) < 1e-4, (step, a.logprob, b.logprob)


def test_speculation_and_a_grammar_run_through_the_experts(moe_folder, moe_llm):
    """Drafts checked through the sparse blocks as any row: suffix decoding proposes, for a prompt
    asked again, the output the first answer left in its tree (every draft row checked: rows_free);
    both answers are the plain engine's tokens and logprobs. A regex-constrained request on the same
    engine ends inside its pattern."""
    generator = torch.Generator().manual_seed(4)
    prompt = {"prompt_token_ids": torch.randint(100, 49000, (12,), generator=generator).tolist()}
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    spec_llm = rows_free(
        engine(moe_folder, speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    )
    plain = moe_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    for _ in range(2):
        ours = spec_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert ours.token_ids == plain.token_ids
        for step, token in enumerate(ours.token_ids):
            a, b = ours.logprobs[step][token].logprob, plain.logprobs[step][token].logprob
            assert abs(a - b) < 1e-4, (step, a, b)
    stats = spec_llm.llm_engine.core.scheduler.draft_policy.stats
    assert stats.num_accepted_tokens > 0, stats

    pattern = "(yes|no)-[0-9]{3}"
    constrained = SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    text = spec_llm.generate("Answer:", constrained, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(pattern, text), text


def test_an_int8_kv_cache_stays_near_the_float_one(moe_folder, moe_llm):
    """--kv-cache-dtype int8 against the float32 cache, scored teacher-forced on the float run's
    greedy tokens (int8's noise decides near ties, so two greedy runs part: tests/attention/test_kv_quant.py).
    Here (64 tokens): mean |logprob difference| 0.067 (median 0.04; 0.35 and 1.24 where a token's
    experts change with the noise), 62 of 64 still int8's first choice; the same test on a dense
    tiny Qwen3 of this shape: mean 0.024, max 0.09, 63 of 64. Asked: mean < 0.25, 80%."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt_ids = prompts()
    outputs = moe_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    sequences = [ids + list(o.outputs[0].token_ids) for ids, o in zip(prompt_ids, outputs, strict=True)]
    starts = [len(ids) for ids in prompt_ids]
    int8 = engine(moe_folder, kv_cache_dtype="int8")
    assert int8.llm_engine.core.worker.runner.kv_caches[0][0].dtype == torch.int8
    reference, quantized = score(moe_llm, sequences, starts), score(int8, sequences, starts)
    differences = [abs(a[0] - b[0]) for a, b in zip(reference, quantized, strict=True)]
    assert all(map(math.isfinite, (q[0] for q in quantized)))
    mean = sum(differences) / len(differences)
    assert mean < 0.25, f"mean |logprob difference| {mean:.4f} (max {max(differences):.4f})"
    first_choices = sum(q[1] for q in quantized)
    assert first_choices >= 0.8 * len(quantized), f"{first_choices} of {len(quantized)}"


# ---- GGUF ----------------------------------------------------------------------------------------


def dequantized_as_written(model, qtype):
    """`model` with each expert's weights as `qtype` holds them: quantized and dequantized by the
    `gguf` package, as write_tiny_gguf quantizes them into the file (gate and up apart, as the
    file stacks them; no GGUF reader involved, so none is checked against itself)."""

    def round_trip(weights: torch.Tensor) -> torch.Tensor:
        blocks = gguf.quants.quantize(weights.contiguous().numpy(), qtype)
        return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))

    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:  # the dense layer
                continue
            gate, up = experts.gate_up_proj.chunk(2, dim=1)
            experts.gate_up_proj.copy_(torch.cat([round_trip(gate), round_trip(up)], dim=1))
            experts.down_proj.copy_(round_trip(experts.down_proj))
    return model


@pytest.fixture(
    scope="module", params=[pytest.param(KIND.Q8_0, marks=pytest.mark.slow), KIND.Q4_0], ids=["Q8_0", "Q4_0"]
)  # make test-fast keeps Q4_0
def quantized_gguf(request, tmp_path_factory):
    """(transformers on the file's dequantized weights, the GGUF path, its experts' format): a
    GGUF of the random model with the experts in `param`, the rest float32 as written."""
    folder = tmp_path_factory.mktemp("gguf")
    model = save_with_random_norms(random_model(), folder / "hf")  # (the tokenizer files copied first)
    qtype = request.param
    path = folder / "tiny-moe.gguf"
    write_tiny_gguf(model, path, {"ffn_gate_exps": qtype, "ffn_up_exps": qtype, "ffn_down_exps": qtype})
    return dequantized_as_written(model, qtype), path, qtype


def test_gguf_experts_read_per_expert_in_their_blocks(quantized_gguf):
    """Each expert's slice of the stacked tensors, kept in the file's blocks, dequantizes exactly
    to the `gguf` package's dequantization of what it wrote; the router and the dense layer come as
    floats."""
    model, path, qtype = quantized_gguf
    config = model_config_from_folder(converted_folder(path))
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 96)
    assert config.norm_topk_prob and config.mlp_only_layers == (1,)  # llama.cpp renormalizes
    ours = dict(iter_gguf_weights(path, config))
    state = model.state_dict()
    for layer in (0, 2, 3):
        prefix = f"model.layers.{layer}.mlp"
        assert torch.equal(ours[f"{prefix}.gate.weight"], state[f"{prefix}.gate.weight"])
        for expert in range(8):
            gate, up = state[f"{prefix}.experts.gate_up_proj"][expert].chunk(2)
            expected = {
                "gate_proj": gate,
                "up_proj": up,
                "down_proj": state[f"{prefix}.experts.down_proj"][expert],
            }
            for projection, weight in expected.items():
                read = ours[f"{prefix}.experts.{expert}.{projection}.weight"]
                assert isinstance(read, BlockQuantized) and read.format == qtype.name
                assert torch.equal(read.dequantize(), weight), (layer, expert, projection)
    assert not any(".experts." in name for name in ours if name.startswith("model.layers.1."))


@pytest.mark.parametrize(
    "qtype", [KIND.F32, KIND.F16, KIND.Q8_0, KIND.Q4_0, KIND.Q4_K, KIND.Q6_K], ids=lambda kind: kind.name
)
def test_stacked_experts_split_per_expert_in_each_format(qtype):
    """A layer's ffn_down_exps as llama.cpp stores it (GGUF shape [columns, rows, experts]: each
    expert's rows one run of the bytes) in the formats Qwen3-30B-A3B files use (Q4_K_M: Q4_K
    gate/up, Q6_K down; Q8_0, Q4_0, F16, F32): each expert's matrix, kept in its blocks where
    quantized, is the `gguf` package's reading of the whole tensor at that expert. Rows of 512:
    K-quants' 256-value blocks, which the tiny model's width (64) cannot hold."""
    experts, rows, columns = 3, 40, 512
    if qtype in (KIND.F32, KIND.F16):
        dtype = np.float32 if qtype == KIND.F32 else np.float16
        values = np.random.default_rng(0).standard_normal((experts * rows, columns)).astype(dtype)
        raw = values.view(np.uint8)
    else:
        raw = random_gguf_blocks(qtype, experts * rows, columns)
    theirs = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    tensor = GGUFTensor("blk.0.ffn_down_exps.weight", qtype, (columns, rows, experts), raw.reshape(-1))
    read = list(gguf_experts_apart(tensor, "model.layers.0.mlp.experts.down_proj.weight"))
    assert [name for name, _ in read] == [
        f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)
    ]
    for expert, (_, weight) in enumerate(read):
        theirs_here = theirs.view(experts, rows, columns)[expert]
        if qtype in (KIND.F32, KIND.F16):
            assert torch.equal(weight, theirs_here)
            continue
        assert isinstance(weight, BlockQuantized) and weight.still_encoded is not None
        assert weight.format == held_form(qtype)[0]  # Q6_K's "as 8-bit"
        own_rows = raw.reshape(experts, rows, -1)[expert]  # the expert's bytes read as a matrix alone
        alone = read_tensor(GGUFTensor("expert", qtype, (columns, rows), own_rows.reshape(-1)))
        assert torch.equal(weight.dequantize(), alone.dequantize())
        if qtype != KIND.Q6_K:  # read without loss; Q6_K widened to 8 bits per block of 32
            assert torch.equal(weight.dequantize(), theirs_here)


def test_gguf_dequantized_matches_transformers(quantized_gguf):
    """--quantization none: the file's experts dequantized into float32, tokens and logprobs as
    transformers' on the same dequantized weights (the stacked tensors split and named right)."""
    model, path, qtype = quantized_gguf
    assert_matches_reference(model, engine(path), f"{qtype.name} dequantized")


def rounded_activations(model):
    """A copy of `model` whose experts compute as the integer kernel documents (cpu_ops.quant_linear):
    each row of an expert's input, and of its down projection's, rounded to 8 bits per block of 32
    (llama.cpp's Q8_0: d = max|x| / 127, round(x / d) * d), the products then exact in float32. The
    rest is transformers' eager loop over experts, unchanged."""
    import copy

    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    def rounded(x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
        return (q * d).reshape(x.shape)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            gate, up = F.linear(rounded(hidden_states[token_idx]), self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(rounded(self.act_fn(gate) * up), self.down_proj[expert])
            out.index_add_(0, token_idx, y * top_k_weights[token_idx, top_k_pos, None])
        return out

    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, Qwen3MoeExperts):
            module.forward = forward.__get__(module)
    return model


@pytest.mark.skipif(not cpu_ops.serves_quant_linear(4, 64, 64), reason="no integer kernel on this build")
def test_gguf_experts_kept_in_blocks_agree_with_transformers(quantized_gguf):
    """The experts kept in the file's blocks and computed by the integer kernel, never dequantized;
    scored teacher-forced on transformers' greedy tokens (the dequantized weights).

    Against transformers with its experts' inputs rounded as the kernel rounds them (8 bits per
    block of 32, rounded_activations): the same logprobs, but for a rare input that lands on a
    rounding step or a near tie of the router. Here (AVX-512, float32, 64 tokens): mean 1e-4 (Q8_0)
    and 4e-4 (Q4_0), max 0.006; 95% within 0.02 is asked, which an expert read from the wrong
    bytes or scaled wrong misses everywhere (the rounding alone moves tokens by 0.06-0.08 on
    average).

    Against plain transformers: that rounding moves this random model's logprobs (initializer
    range 0.3: sharp distributions, and the router's top-2 margins down to 1e-3 in probability)
    by mean 0.083 (Q8_0: one token by 1.85, where a flipped route changes a layer's experts) and
    0.060 (Q4_0), with 60 and 62 of 64 tokens still the first choice. The dense GGUF test with the
    kernel (test_quantized_weights.py) sees 0.036 and asks < 0.08, the default model's blocks 0.04
    and < 0.15, --quantization int8 0.12-0.17 and < 0.35; here < 0.25 and 80% first choices,
    three times the worst figure, for another CPU's rounding (AVX2's sums in another order)."""
    model, path, qtype = quantized_gguf
    llm = engine(path, quantization=None)
    for block in moe_blocks(llm):
        for expert in block.expert_mlps:
            assert expert.gate_up_proj.weight_format == expert.down_proj.weight_format == qtype.name
    held = llm.llm_engine.core.worker.weights_bytes_by_format()
    planned = gguf_weights_by_format(path, "float32")  # `pagedllm plan` counts the same bytes
    assert abs(held[qtype.name] - planned[qtype.name]) <= 0.01 * held[qtype.name] + 4096

    rounded_model = rounded_activations(model)
    differences, from_rounded, first_choices = [], [], 0
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for ids in prompts():
        tokens, _ = reference(model, ids)
        sequence = ids + tokens
        ref, ref_rounded = teacher_forced(model, sequence), teacher_forced(rounded_model, sequence)
        output = llm.generate({"prompt_token_ids": sequence}, params, use_tqdm=False)[0]
        for position in range(len(ids), len(sequence)):
            entry = output.prompt_logprobs[position]
            token = sequence[position]
            differences.append(abs(entry[token].logprob - float(ref[position - 1, token])))
            from_rounded.append(abs(entry[token].logprob - float(ref_rounded[position - 1, token])))
            first_choices += token == max(entry, key=lambda t: entry[t].logprob)
    near = sum(d < 0.02 for d in from_rounded)
    assert near >= 0.95 * len(from_rounded), (
        f"{qtype.name}: {near} of {len(from_rounded)} tokens within 0.02 of the rounded reference "
        f"(mean {sum(from_rounded) / len(from_rounded):.4f}, max {max(from_rounded):.4f})"
    )
    mean = sum(differences) / len(differences)
    assert mean < 0.25, f"{qtype.name}: mean |logprob difference| {mean:.4f} (max {max(differences):.4f})"
    assert first_choices >= 0.8 * len(differences), f"{first_choices} of {len(differences)}"


@pytest.mark.skipif(not cpu_ops.serves_quant_linear(4, 64, 64), reason="no integer kernel on this build")
def test_grouped_expert_kernel_gives_the_per_expert_calls_results(quantized_gguf):
    """Experts kept in blocks run grouped (cpu_ops.moe_quant_linear: two calls a layer for all the
    step's experts); a call per expert gives every logprob the same, bit for bit (each row's result
    is its own, whatever rows share a call), on prompts of many rows and on decode steps."""
    _, path, _ = quantized_gguf
    llm = engine(path, quantization=None)
    blocks = moe_blocks(llm)
    assert all(block.grouped is not None for block in blocks)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=2, ignore_eos=True)

    def run():
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts()], params, use_tqdm=False)
        return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    grouped = run()
    for block in blocks:
        block.grouped = None
    assert run() == grouped


# ---- the block alone -----------------------------------------------------------------------------


def blocks(**overrides):
    """transformers' Qwen3MoeSparseMoeBlock with random weights and ours holding the same ones."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HFBlock

    hf_config = moe_config(**overrides)
    hf_config._experts_implementation = "eager"
    torch.manual_seed(2)
    theirs = HFBlock(hf_config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0, 0.3)
    ours = sparse_moe_block(model_config_from_dict(hf_config.to_dict()))
    load_block(ours, theirs)
    return theirs, ours


def load_block(ours, theirs) -> None:
    """theirs' weights into ours, through our layers' weight_loaders as the loader hands them."""
    ours.gate.weight_loader(ours.gate.weight, theirs.gate.weight.detach(), None)
    for expert, mlp in enumerate(ours.experts.expert_mlps):
        gate, up = theirs.experts.gate_up_proj[expert].detach().chunk(2)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, gate, 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, up, 1)
        mlp.down_proj.weight_loader(mlp.down_proj.weight, theirs.experts.down_proj[expert].detach(), None)


def assert_near(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for float32 rounding at the outputs' scale (up to ~40 here): the same experts
    and weights, the products summed in another order where the matrix kernel takes a group's
    rows in another order (transformers gathers them by top-k position, then token); one expert
    chosen wrongly would move outputs by their own size."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@torch.inference_mode()
def both(theirs, ours, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return theirs(hidden.unsqueeze(0))[0], ours(hidden)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_every_expert_chosen_when_top_k_is_all_of_them(norm_topk_prob):
    theirs, ours = blocks(num_experts_per_tok=8, norm_topk_prob=norm_topk_prob)
    hidden = torch.randn(11, 64)
    expected, got = both(theirs, ours, hidden)
    assert_near(got, expected)


def test_an_expert_no_token_chooses_is_never_read():
    """Expert 3's router row far below every other for positive inputs: no token picks it, and its
    weights (NaN here) are not read: the output is finite and transformers'."""
    theirs, ours = blocks()
    with torch.no_grad():
        theirs.gate.weight[3] = -100.0
        theirs.experts.gate_up_proj[3] = float("nan")
        theirs.experts.down_proj[3] = float("nan")
    load_block(ours, theirs)
    hidden = torch.rand(16, 64) + 0.1
    _, ids = select_experts(ours.gate(hidden), 2, True)
    assert 3 not in ids.tolist() and len(set(ids.flatten().tolist())) > 2
    expected, got = both(theirs, ours, hidden)
    assert torch.isfinite(got).all()
    assert_near(got, expected)


def test_ties_in_router_logits_resolve_as_transformers_resolves_them():
    """Experts 1, 5 and 6 with the same router row: equal logits, a three-way tie for the top 2
    wherever they lead. The expert torch.topk leaves out must be the one transformers leaves out:
    their weights differ, so another choice shows in the output."""
    theirs, ours = blocks()
    with torch.no_grad():
        row = torch.full((64,), 0.5)
        for expert in (1, 5, 6):
            theirs.gate.weight[expert] = row
    load_block(ours, theirs)
    hidden = torch.randn(32, 64)
    logits = ours.gate(hidden)
    assert torch.equal(logits[:, 1], logits[:, 5]) and torch.equal(logits[:, 1], logits[:, 6])
    tied_at_top = (logits.topk(3).indices.sort().values == torch.tensor([1, 5, 6])).all(-1)
    assert tied_at_top.sum() >= 3, "some tokens must have the tie at the top"
    expected, got = both(theirs, ours, hidden)
    assert_near(got, expected)


def test_each_expert_computes_once_per_step_over_all_its_rows():
    """Grouped by expert: an expert any token chose runs its gate_up and down projections once,
    over exactly the rows routed to it; an expert none chose does not run."""
    theirs, ours = blocks()
    calls: dict[int, list[int]] = {expert: [] for expert in range(8)}
    for expert, mlp in enumerate(ours.experts.expert_mlps):
        impl = mlp.gate_up_proj.impl

        def counted(x, weight, bias, expert=expert, impl=impl):
            calls[expert].append(x.shape[0])
            return impl(x, weight, bias)

        mlp.gate_up_proj.impl = counted
    hidden = torch.randn(12, 64)
    _, ids = select_experts(ours.gate(hidden), 2, True)
    expected, got = both(theirs, ours, hidden)
    assert_near(got, expected)
    for expert in range(8):
        routed = int((ids == expert).sum())
        assert calls[expert] == ([routed] if routed else []), (expert, calls[expert], routed)


# ---- configs: which layers are sparse, what a plan counts -----------------------------------------


def meta_model(config):
    """transformers' model of `config` on the meta device: its modules and parameter shapes, no
    memory (a 30B model's in a second)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("step", "mlp_only"), [(1, []), (2, []), (2, [3]), (3, [0, 5])])
def test_sparse_layers_are_those_transformers_builds(step, mlp_only):
    """decoder_sparse_step and mlp_only_layers: the layers transformers gives experts are ours,
    and the parameters counted from the config are its parameters."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HFBlock

    hf_config = moe_config(num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    model = meta_model(hf_config)
    ours = model_config_from_dict(hf_config.to_dict())
    assert [ours.is_sparse_layer(i) for i in range(6)] == [
        isinstance(layer.mlp, HFBlock) for layer in model.model.layers
    ]
    assert ours.num_parameters() == sum(p.numel() for p in model.parameters())


def test_plan_counts_total_and_active_parameters(tmp_path, capsys):
    """Qwen3-30B-A3B's sizes (its config.json's): `pagedllm plan` counts transformers' parameters
    (its model built on the meta device), and those a token uses: all but the 120 of 128 experts
    it is not routed to on each of the 48 layers (the model card's 3.3B)."""
    from pagedllm.entrypoints.cli.main import main

    hf_config = moe_config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        mlp_only_layers=[],
        max_position_embeddings=40960,
    )
    hf_config.save_pretrained(tmp_path)
    model = meta_model(hf_config)
    total = sum(p.numel() for p in model.parameters())
    experts = model.model.layers[0].mlp.experts
    per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // 128
    active = total - 48 * (128 - 8) * per_expert

    argv = ["plan", "--model", str(tmp_path), "--dtype", "bfloat16", "--kv-cache-memory-bytes", "1GiB"]
    main([*argv, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert (plan["num_parameters"], plan["active_parameters_per_token"]) == (total, active)
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 1) == 3.4  # "30.5B, 3.3B activated"
    assert plan["weights_bytes"] == 2 * total
    assert plan["decode_step_weight_bytes"] == 2 * active  # bfloat16: 2 bytes a parameter, all read
    main(argv)
    printed = capsys.readouterr().out
    assert f"active           {active:,} parameters a token (8 of 128 experts on 48 of 48 layers" in printed
    assert f"decode reads     about {2 * active / 1e9:.2f} GB" in printed


# ---- configs refused -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8"),
        ({"num_experts": 0}, "num_experts 0 is not an integer in"),
        ({"num_experts": 10**6}, "num_experts 1000000 is not an integer in"),
        ({"num_local_experts": 4096, "num_hidden_layers": 64}, "258,048 experts, more than any model"),
        ({"num_local_experts": 4, "num_experts": 8}, "num_experts 8 and num_local_experts 4 disagree"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
        ({"mlp_only_layers": [4]}, "mlp_only_layers a list of 1 items is not a list of layer indices"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob 'yes' is not true or false"),
    ],
)
def test_a_config_out_of_bounds_is_refused(change, message):
    config = moe_config().to_dict() | change
    with pytest.raises(ModelLoadError, match=message):
        model_config_from_dict(config, source="config.json")


def test_tensor_parallel_sizes_must_divide_the_experts():
    """Each rank holds as many experts as the others, whole (tests/distributed: TP=2 as TP=1)."""
    config = model_config_from_dict(moe_config(num_experts=5).to_dict())
    config.check_tensor_parallel_size(1)
    with pytest.raises(ValueError, match=r"2 does not divide this model's 5 experts.*: 1$"):
        config.check_tensor_parallel_size(2)
    model_config_from_dict(moe_config(num_experts=6).to_dict()).check_tensor_parallel_size(2)


@pytest.mark.slow  # an eval of its own; the fast set keeps the FP8 checkpoint's
def test_eval_weight_quant_checks_the_experts_as_stored(quantized_gguf, capsys):
    """`pagedllm eval weight-quant` on a GGUF whose experts are quantized: one row, the file as
    served (experts in their blocks, the grouped kernel) against its values in float."""
    import argparse

    from pagedllm.eval import weight_quant

    _, path, qtype = quantized_gguf
    parser = argparse.ArgumentParser()
    weight_quant.add_arguments(parser)
    argv = ["--model", str(path), "--json", "--max-tokens", "4", "--dtype", "float32", "--max-model-len=512"]
    weight_quant.main(parser.parse_args(argv))
    (row,) = json.loads(capsys.readouterr().out)["formats"]
    assert row["quantization"] == "gguf" and row["all_finite"] and row["weights_ratio"] < 1
    if cpu_ops.serves_quant_linear(4, 32, 32):  # measured: -0.4% (Q8_0), -0.03% (Q4_0) on host C
        assert abs(row["perplexity_relative_diff"]) < 0.05, qtype
