"""Weights kept quantized: GGUF blocks read without loss, the block form's algebra, --quantization's
rules, and models served from quantized weights against the same weights dequantized."""

from __future__ import annotations

import dataclasses
import types
from typing import get_args

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import Quantization
from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.linear_method import BlockQuantizedLinearMethod, FloatLinearMethod
from pagedllm.layers.quantization import BlockQuantized, join_rows, quantize
from pagedllm.model.checkpoint_quant import CheckpointQuantization, Scheme
from pagedllm.model.gguf_weights import read_tensor
from pagedllm.model.locate import default_model_path
from pagedllm.model_loader import check_quantization
from pagedllm.planner import gguf_weights_by_format
from pagedllm.quantization import registry
from pagedllm.quantization.base import HeldByCheckpoint
from pagedllm.quantization.registry import QUANTIZATION_METHODS

from ..helpers import (
    TEST_ENGINE_ARGS,
    TINY,
    random_gguf_blocks,
    save_tiny_model,
    tiny_architectures,
    write_tiny_gguf,
)

KIND = gguf.GGMLQuantizationType


def _gguf_tensor(raw: np.ndarray, qtype, rows: int, columns: int):
    """What GGUFReader yields for one tensor: raw blocks, the type, the shape in GGUF's order."""
    return types.SimpleNamespace(data=raw, tensor_type=qtype, shape=(columns, rows))


@pytest.mark.parametrize("qtype", [KIND.Q8_0, KIND.Q4_0, KIND.Q4_1, KIND.Q4_K, KIND.Q5_K])
def test_gguf_blocks_read_without_loss(qtype):
    rows, columns = 48, 512
    raw = random_gguf_blocks(qtype, rows, columns)
    ours = read_tensor(_gguf_tensor(raw, qtype, rows, columns))
    assert isinstance(ours, BlockQuantized) and ours.format == qtype.name
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, columns))
    assert torch.equal(ours.dequantize(), theirs)  # from the file's bytes (the kernel, where built)
    assert torch.equal(read_out(ours).dequantize(), theirs)  # from codes, scales and mins


def read_out(weight: BlockQuantized) -> BlockQuantized:
    """The same weight from its codes, scales and mins: dequantized in Python, not from the bytes."""
    return BlockQuantized(weight.q, weight.scales, weight.mins, weight.bits, weight.format)


@pytest.mark.skipif(not cpu_ops.serves_quant_linear(4, 64, 256), reason="no integer kernel on this build")
@pytest.mark.parametrize("qtype", [KIND.Q8_0, KIND.Q4_0, KIND.Q4_1, KIND.Q4_K, KIND.Q5_K, KIND.Q6_K])
def test_gguf_rows_pack_as_their_read_out_blocks(qtype):
    """The packer that reads GGUF's bytes gives the generic packer's blob byte for byte, also for
    rows chosen and joined while still encoded (q/k/v, the rotary order, tensor-parallel shares)."""
    rows, columns = 70, 512  # rows not a whole group of 64: padding too
    first = read_tensor(_gguf_tensor(random_gguf_blocks(qtype, rows, columns, seed=1), qtype, rows, columns))
    second = read_tensor(_gguf_tensor(random_gguf_blocks(qtype, rows, columns, seed=2), qtype, rows, columns))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    weight = join_rows([first.permute_rows(order), second.rows(3, 50)])
    encoded = weight.still_encoded
    assert encoded is not None and weight.shape == (rows + 50, columns)
    packed = cpu_ops.pack_gguf_linear(encoded.raw, encoded.encoding, columns)
    assert torch.equal(packed, cpu_ops.pack_quant_linear(weight.q, weight.scales, weight.mins, weight.bits))


@pytest.mark.skipif(not cpu_ops.is_built(), reason="no C++ kernels on this build")
@pytest.mark.parametrize("qtype", [KIND.Q8_0, KIND.Q4_0, KIND.Q4_1, KIND.Q4_K, KIND.Q5_K, KIND.Q6_K])
def test_looked_up_gguf_rows_read_out_as_their_blocks_dequantized(qtype):
    """An embedding held as the file stores it: the C++ lookup gives each row's values bit for bit
    as the blocks read out in Python and dequantized, in any order, repeated; a bad id is refused."""
    rows, columns = 40, 512
    raw = random_gguf_blocks(qtype, rows, columns, seed=3)
    table = read_tensor(_gguf_tensor(raw, qtype, rows, columns))
    ids = torch.tensor([7, 0, 39, 7, 12])
    got = cpu_ops.gguf_rows(torch.from_numpy(raw), ids, qtype.name, columns)
    assert torch.equal(got, read_out(table).dequantize()[ids])
    with pytest.raises(RuntimeError, match="not a row"):
        cpu_ops.gguf_rows(torch.from_numpy(raw), torch.tensor([rows]), qtype.name, columns)


def test_other_block_formats_are_widened_to_8_bits():
    rows, columns = 32, 256
    weight = np.random.default_rng(1).normal(0, 0.02, size=(rows, columns)).astype(np.float32)
    raw = gguf.quants.quantize(weight, KIND.Q5_0)
    ours = read_tensor(_gguf_tensor(raw, KIND.Q5_0, rows, columns))
    assert ours.bits == 8 and ours.format == "Q5_0 as 8-bit"
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, KIND.Q5_0).reshape(rows, columns))
    step = ours.scales.repeat_interleave(32, dim=1)  # one 8-bit step per block
    assert ((ours.dequantize() - theirs).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_rounds_to_the_nearest_step(bits):
    weight = torch.randn(64, 256) * 0.05
    quantized = quantize(weight, bits)
    step = quantized.scales.repeat_interleave(32, dim=1)
    assert ((quantized.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    assert int(quantized.q.min()) >= (0 if bits == 4 else -128) and int(quantized.q.max()) <= (
        15 if bits == 4 else 127
    )


def test_slices_and_joins_keep_the_weights():
    weight = torch.randn(96, 128)
    q4, q8 = quantize(weight[:32], 4), quantize(weight[32:], 8)
    joined = join_rows([q4, q8])  # 4 bits widened to 8 without loss
    assert joined.bits == 8 and joined.format == "int4+int8"
    assert torch.allclose(joined.dequantize(), torch.cat([q4.dequantize(), q8.dequantize()]), atol=1e-6)
    assert torch.equal(q8.rows(8, 16).dequantize(), q8.dequantize()[8:24])
    assert torch.equal(q8.columns(32, 64).dequantize(), q8.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="whole blocks"):
        q8.columns(16, 32)
    order = torch.randperm(64)
    assert torch.equal(q8.permute_rows(order).dequantize(), q8.dequantize()[order])


def test_quantization_flag_refuses_what_cannot_apply():
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        check_quantization("gguf", is_gguf=False)
    with pytest.raises(ValueError, match="quantized already"):
        check_quantization("int4", is_gguf=True)
    check_quantization(None, is_gguf=True)
    check_quantization("none", is_gguf=True)


def test_default_gguf_served_quantized_agrees_with_its_dequantized_run(llm, caplog):
    """The default model's own Q4_1/Q8_0 blocks against the same weights dequantized (the
    reference run, `llm`), scored on the reference's greedy tokens (teacher-forced): each token's
    logprob stays close, and so does the perplexity. Not the length of the run the two greedy
    decodes share: one early near tie that another CPU's rounding flips changes every later token.
    Here (AVX-512-BF16, float32): mean |logprob difference| 0.04, perplexity +0.3%, 70 of 72
    tokens still the quantized run's first choice; the bounds leave three times that room."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokenize = llm.get_tokenizer()
    prompt_ids = [tokenize(p).input_ids for p in prompts]
    sequences = [
        ids + list(out.outputs[0].token_ids)
        for ids, out in zip(prompt_ids, llm.generate(prompts, greedy, use_tqdm=False), strict=True)
    ]
    with caplog.at_level("INFO"):
        quantized = LLM(**{**TEST_ENGINE_ARGS, "quantization": None})
    assert "Q4_1" in caplog.text  # the start-up line says how the weights are held
    reference_scores = _score_answers(llm, sequences, [len(ids) for ids in prompt_ids])
    quantized_scores = _score_answers(quantized, sequences, [len(ids) for ids in prompt_ids])
    differences = [
        abs(a.logprob - b.logprob) for a, b in zip(reference_scores, quantized_scores, strict=True)
    ]
    mean_difference = sum(differences) / len(differences)
    assert mean_difference < 0.15, f"mean |logprob difference| {mean_difference:.3f} over the answers"
    perplexity_ratio = np.exp(
        sum(a.logprob - b.logprob for a, b in zip(reference_scores, quantized_scores, strict=True))
        / len(differences)
    )
    assert perplexity_ratio < 1.10, (
        f"the quantized run's perplexity is {perplexity_ratio:.3f}x the reference's"
    )
    first_choices = sum(b.is_first_choice for b in quantized_scores)
    assert first_choices >= 0.8 * len(quantized_scores), f"{first_choices} of {len(quantized_scores)}"

    # `pagedllm plan` counts the same bytes from the file's tensor directory alone
    planned = gguf_weights_by_format(default_model_path(), TEST_ENGINE_ARGS["dtype"])
    held = quantized.llm_engine.core.worker.weights_bytes_by_format()
    assert planned.keys() == held.keys()
    for name, size in held.items():
        assert abs(planned[name] - size) <= 0.01 * size + 4096, (name, planned[name], size)


@dataclasses.dataclass
class Score:
    logprob: float
    """The logprob the engine gave the token."""
    is_first_choice: bool
    """Whether it was the engine's most likely token there."""


def _score_answers(engine: LLM, sequences: list[list[int]], answer_starts: list[int]) -> list[Score]:
    """Each answer token of `sequences` (from its answer_start on) scored by `engine` as a prompt."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = engine.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    scores = []
    for output, sequence, start in zip(outputs, sequences, answer_starts, strict=True):
        for position in range(start, len(sequence)):
            candidates = output.prompt_logprobs[position]
            first = max(candidates, key=lambda token: candidates[token].logprob)
            token = sequence[position]
            scores.append(Score(candidates[token].logprob, token == first))
    return scores


@dataclasses.dataclass
class Run:
    logprobs: torch.Tensor
    """The logprob of each prompt token after the first."""
    tokens: list[int]
    """Greedy tokens after the prompt."""
    formats: dict[str, int]
    """Weight bytes by format."""


def _run(model, quantization: str | None) -> Run:
    engine = LLM(str(model), **{**TEST_ENGINE_ARGS, "max_model_len": 512, "quantization": quantization})
    ids = list(range(100, 160))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    out = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    logprobs = torch.tensor([out.prompt_logprobs[i][token].logprob for i, token in enumerate(ids) if i])
    return Run(
        logprobs, list(out.outputs[0].token_ids), engine.llm_engine.core.worker.weights_bytes_by_format()
    )


# The mean |logprob difference| of the prompt's tokens, over seeds 0-3 of the tiny model, with the
# integer kernel / dequantized: int8 0.12-0.17 / 0.07-0.10, int4 0.86-1.30 / 0.86-1.27 (seed 0:
# 0.12 / 0.07 and 0.86 / 0.86). Bounds at about twice the largest leave room for another CPU's
# rounding and still tell 8 bits from 4.
@pytest.mark.parametrize(("quantization", "tolerance"), [("int8", 0.35), ("int4", 2.5)])
@pytest.mark.parametrize(
    "kernel",  # make test-fast keeps the integer kernel, the whole suite both
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["integer-kernel", "dequantized"],
)
def test_float_checkpoint_quantized_at_load_stays_near_it(
    quantization, tolerance, kernel, tmp_path, monkeypatch
):
    """--quantization int8/int4 against the same float checkpoint (--quantization none): the
    logprobs of 59 prompt tokens of a tiny random Qwen2 stay close, whether the integer kernel
    computes from the blocks or (no kernel on this CPU) they are dequantized at load."""
    if kernel and not cpu_ops.serves_quant_linear(4, 32, 32):
        pytest.skip("no integer kernel in this CPU's build")
    if not kernel:
        monkeypatch.setattr(cpu_ops, "serves_quant_linear", lambda *args: False)
    save_tiny_model("qwen2-bias", tmp_path)
    reference, ours = _run(tmp_path, "none"), _run(tmp_path, quantization)
    assert (quantization in ours.formats) == kernel and quantization not in reference.formats
    difference = (ours.logprobs - reference.logprobs).abs()
    print(quantization, float(difference.max()), float(difference.mean()))
    assert float(difference.mean()) < tolerance


@pytest.mark.parametrize("float_part", [0, 1, 2])
def test_fused_parts_mixing_float_and_quantized_are_held_as_float(float_part):
    """q/k/v where one part loads float, before or after the quantized ones: every part is kept,
    the quantized ones dequantized into the float weight (exact), none dropped."""
    sizes = [64, 32, 32]
    layer = MergedColumnParallelLinear(64, sizes, False, None)
    parts = [torch.randn(size, 64) for size in sizes]
    loaded = [part if i == float_part else quantize(part, 4) for i, part in enumerate(parts)]
    for i, part in enumerate(loaded):
        layer.weight_loader(layer.weight, part, i)
    expected = torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in loaded])
    assert layer.quantized is None and torch.equal(layer.weight.data, expected)
    layer.choose_impl(torch.device("cpu"), torch.float32)
    assert layer.weight_format == ""
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)


def test_a_row_parallel_share_that_cuts_blocks_is_held_as_float():
    tp = types.SimpleNamespace(rank=1, world_size=2)
    weight = quantize(torch.randn(48, 160), 4)
    cut = RowParallelLinear(160, 48, tp)  # 80 inputs a rank: two and a half blocks
    cut.weight_loader(cut.weight, weight, None)
    assert cut.quantized is None and torch.equal(cut.weight.data, weight.dequantize()[:, 80:])
    whole = RowParallelLinear(128, 48, tp)  # 64 a rank: whole blocks stay quantized
    weight = quantize(torch.randn(48, 128), 4)
    whole.weight_loader(whole.weight, weight, None)
    assert whole.quantized is not None and torch.equal(
        whole.quantized.dequantize(), weight.dequantize()[:, 64:]
    )


@pytest.mark.skipif(not cpu_ops.serves_quant_linear(4, 64, 256), reason="no integer kernel on this build")
def test_fused_parts_of_different_bits_are_packed_each_at_their_own():
    """q and k at 4 bits beside v at 8 (a Q4_K_M file's Q4_K and Q6_K): each run of equal bits
    packed on its own, not all widened to 8 bits with mins; the output is each run's kernel
    output side by side (bit for bit: a row's result is its own), bias included."""
    gen = torch.Generator().manual_seed(7)
    layer = MergedColumnParallelLinear(256, [128, 64, 64], True, None)
    shapes = [(128, 4), (64, 4), (64, 8)]  # q, k, v: rows and bits
    parts = [quantize(torch.randn(rows, 256, generator=gen), bits) for rows, bits in shapes]
    for shard_id, part in enumerate(parts):
        layer.weight_loader(layer.weight, part, shard_id)
    bias = torch.randn(256, generator=gen)
    layer.bias.data.copy_(bias)
    layer.choose_impl(torch.device("cpu"), torch.float32)
    assert layer.weight_format == "int4+int8"
    low, high = join_rows(parts[:2]), parts[2]
    packed_low = cpu_ops.pack_quant_linear(low.q, low.scales, low.mins, 4)
    packed_high = cpu_ops.pack_quant_linear(high.q, high.scales, high.mins, 8)
    assert layer.weight.numel() == packed_low.numel() + packed_high.numel()
    widened = join_rows(parts)  # all at 8 bits, with mins
    widened_bytes = cpu_ops.pack_quant_linear(widened.q, widened.scales, widened.mins, 8).numel()
    assert layer.weight.numel() < widened_bytes
    x = torch.randn(3, 256, generator=gen)
    expected = torch.cat(
        [
            cpu_ops.quant_linear(x, packed_low, 4, 192, 256, bias[:192]),
            cpu_ops.quant_linear(x, packed_high, 8, 64, 256, bias[192:]),
        ],
        dim=1,
    )
    assert torch.equal(layer(x), expected)


# llama.cpp's quantizer may leave a part of a fused projection float (attn_v, ffn_up here)
MIXED_TYPES = {
    "token_embd": KIND.Q8_0,
    "attn_q": KIND.Q4_0,
    "attn_k": KIND.Q4_1,
    "attn_v": KIND.F32,
    "attn_output": KIND.Q8_0,
    "ffn_gate": KIND.Q4_0,
    "ffn_up": KIND.F16,
    "ffn_down": KIND.Q4_0,
}


@pytest.mark.parametrize(
    ("kernel", "architecture"),
    [  # the dequantized path: one architecture
        (True, "llama"),
        pytest.param(False, "llama", marks=pytest.mark.slow),
        pytest.param(True, "gemma3-gguf", marks=pytest.mark.slow),
    ],
    ids=["integer-kernel-llama", "dequantized-llama", "integer-kernel-gemma3"],
)
def test_gguf_with_float_parts_in_fused_projections_matches_it_dequantized(
    kernel, architecture, tmp_path, monkeypatch
):
    """A GGUF whose qkv and gate_up mix quantized and float parts, served with its quantized
    weights kept, against the whole file dequantized (--quantization none): with no integer
    kernel (every weight dequantized at load) the same logprobs and greedy tokens; with it
    (activations rounded to 8 bits per block, which moves this random model's greedy tokens
    after a few steps) close logprobs. Llama, and Gemma 3 (sliding layers, its own norms)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if kernel and not cpu_ops.serves_quant_linear(4, 32, 32):
        pytest.skip("no integer kernel in this CPU's build")
    if not kernel:
        monkeypatch.setattr(cpu_ops, "serves_quant_linear", lambda *args: False)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, tie_word_embeddings=True) if architecture == "llama" else None
    model = AutoModelForCausalLM.from_config(
        config or tiny_architectures()[architecture], dtype=torch.float32
    )
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(model, path, MIXED_TYPES)
    reference = _run(path, "none")
    ours = _run(path, None)
    assert ours.formats.keys() == ({"Q8_0", "Q4_0", "float32"} if kernel else {"Q8_0", "float32"})
    if not kernel:
        assert torch.equal(ours.logprobs, reference.logprobs) and ours.tokens == reference.tokens
        return
    difference = (ours.logprobs - reference.logprobs).abs()  # observed: mean 0.036, max 0.18
    assert float(difference.mean()) < 0.08 and float(difference.max()) < 0.4


def test_the_quantization_flag_names_exactly_the_registered_methods():
    """pagedllm/config.py's Quantization (the CLI's choices, a layer below quantization/) and the
    registry list the same names: a registered method can be named, a name has a method."""
    assert set(get_args(Quantization)) == set(QUANTIZATION_METHODS)


def test_a_new_checkpoint_method_is_one_registry_row(tmp_path, monkeypatch):
    """A format family registered by one row is detected from quantization_config and checked
    against --quantization through that row alone, with no rule elsewhere naming it."""

    class Hypothetical(HeldByCheckpoint):
        name = "hypothetical"
        held_as = "hypothetical checkpoint"

        @classmethod
        def read(cls, config):
            scheme = Scheme("ct-int", 8, -1, symmetric=True)
            return CheckpointQuantization(cls.name, ((("Linear",), scheme),))

    monkeypatch.setitem(registry.QUANTIZATION_METHODS, "hypothetical", Hypothetical)
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "Hypothetical"}}')
    own = registry.model_quantization(tmp_path)
    assert isinstance(own, Hypothetical) and own.checkpoint.method == "hypothetical"
    registry.check_quantization("hypothetical", "hypothetical")
    registry.check_quantization("none", "hypothetical")
    with pytest.raises(ValueError, match="hypothetical checkpoint is quantized already"):
        registry.check_quantization("int8", "hypothetical")
    with pytest.raises(ValueError, match=r"hypothetical-quantized \(give --quantization hypothetical"):
        registry.check_quantization("awq", "hypothetical")


def test_a_projection_hands_its_weight_to_the_method_that_holds_it():
    """Float until a part loads quantized; back to float when a float part joins quantized ones
    (exact); once prepared, the quantized parts are let go (the packed weight is all it holds)."""
    layer = MergedColumnParallelLinear(64, [32, 32], False, None)
    assert isinstance(layer.method, FloatLinearMethod)
    first = quantize(torch.randn(32, 64), 8)
    layer.weight_loader(layer.weight, first, 0)
    assert isinstance(layer.method, BlockQuantizedLinearMethod) and layer.quantized is first
    second = torch.randn(32, 64)
    layer.weight_loader(layer.weight, second, 1)
    assert isinstance(layer.method, FloatLinearMethod) and layer.quantized is None
    assert torch.equal(layer.weight.data, torch.cat([first.dequantize(), second]))
    quantized = RowParallelLinear(64, 32, None)
    quantized.weight_loader(quantized.weight, quantize(torch.randn(32, 64), 4), None)
    quantized.choose_impl(torch.device("cpu"), torch.float32)
    assert quantized.quantized is None
    assert quantized.weight_format == ("int4" if cpu_ops.serves_quant_linear(4, 32, 64) else "")
