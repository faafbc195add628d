"""FP8 checkpoints (quant_method "fp8", as Qwen's and DeepSeek's *-FP8 releases and AutoFP8 write
them): each projection read into 8-bit blocks of 32 of its dequantized values, served by the
integer kernel, and --quantization none equal to the same weights written as a float checkpoint.

The checkpoints are written here block by block from the format's definition (a scale per block
of 128 x 128, or per tensor: amax / 448, the weight divided by it and cast to float8_e4m3fn;
W = weight x scale), not by the code under test."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli.main import main
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization import BlockQuantized, join_rows, quantize
from pagedllm.model.config_reader import model_config_from_folder
from pagedllm.model.errors import ModelLoadError
from pagedllm.model_loader import check_quantization
from pagedllm.planner import weights_by_format
from pagedllm.quantization.fp8 import FORMAT, iter_fp8_weights
from pagedllm.quantization.registry import model_quantization, read_checkpoint_quantization

from ..helpers import (
    TEST_ENGINE_ARGS,
    TINY,
    assert_greedy_equal,
    hf_greedy,
    save_with_random_norms,
    tiny_architectures,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _tiny_config(name: str):
    """A random tiny model whose projections are not whole blocks of 128: Llama with hidden 192
    and intermediate 416 (q [192, 192], gate [416, 192], down [192, 416]: ragged edge blocks both
    ways), or tests/helpers.py's Qwen3 (gate [160, 64], down [64, 160])."""
    from transformers import LlamaConfig

    if name == "llama-ragged":
        shape = {"hidden_size": 192, "intermediate_size": 416, "num_attention_heads": 6}
        return LlamaConfig(**(TINY | shape), tie_word_embeddings=False)
    return tiny_architectures()[name]


def save_tiny(name: str, folder) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    save_with_random_norms(AutoModelForCausalLM.from_config(_tiny_config(name), dtype=torch.float32), folder)


def to_fp8(weight: torch.Tensor, block: tuple[int, int] | None):
    """float8_e4m3fn codes [N, K], float32 scales [ceil(N / rows), ceil(K / inputs)] (a scalar per
    tensor) and the dequantized weight (float32): codes x scale, block by block."""
    n, k = weight.shape
    rows, inputs = block or (n, k)
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(n / rows), math.ceil(k / inputs))
    values = torch.empty(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            at = (slice(i * rows, (i + 1) * rows), slice(j * inputs, (j + 1) * inputs))
            part = weight[at].float()
            scale = part.abs().max() / FP8_MAX
            codes[at] = (part / scale).to(torch.float8_e4m3fn)
            scales[i, j] = scale
            values[at] = codes[at].float() * scales[i, j]
    return codes, (scales if block else scales.reshape(())), values


def write_fp8_checkpoint(
    float_folder, fp8_folder, dequantized_folder, block: tuple[int, int] | None, static: bool = False
) -> None:
    """A float checkpoint's projections in fp8 (fp8_folder; its other tensors in bfloat16, as the
    releases store them) and the same weights dequantized as a float32 checkpoint
    (dequantized_folder), the reference's. Block-wise: `weight_scale_inv` per block; per tensor:
    `weight_scale`, with an `input_scale` each where `static`."""
    tensors = load_file(float_folder / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS):
            fp8[name] = tensor.to(torch.bfloat16)
            dequantized[name] = fp8[name].float()
            continue
        codes, scales, values = to_fp8(tensor, block)
        fp8[name] = codes
        fp8[f"{module}.{'weight_scale_inv' if block else 'weight_scale'}"] = scales
        if static:
            fp8[f"{module}.input_scale"] = torch.tensor(0.02)
        dequantized[name] = values
    for folder, weights in ((fp8_folder, fp8), (dequantized_folder, dequantized)):
        folder.mkdir(exist_ok=True)
        for file in float_folder.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, folder)
        save_file(weights, folder / "model.safetensors")
    config = json.loads((fp8_folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "static" if static else "dynamic",
        **({"weight_block_size": list(block)} if block else {}),
    }
    (fp8_folder / "config.json").write_text(json.dumps(config))


CHECKPOINTS = [  # (model, weight_block_size or None: per tensor, static activation scales)
    ("llama-ragged", (128, 128), False),
    ("llama-ragged", (48, 80), False),  # blocks that are not whole blocks of 32 inputs
    ("llama-ragged", None, True),
    ("qwen3-head-dim", (128, 128), False),
]


def _write(tmp_path, model: str, block, static: bool):
    save_tiny(model, tmp_path / "float")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized", block, static)
    return tmp_path / "fp8", tmp_path / "dequantized"


def _read(folder, dequantize: bool = False) -> dict:
    """The folder's weights as the loader asks for them."""
    method = model_quantization(folder)
    assert method is not None and method.name == "fp8"
    files = method.files(folder)
    return dict(method.weights(files, model_config_from_folder(folder), dequantize))


@pytest.mark.parametrize(
    ("model", "block", "static"),
    [  # make test-fast keeps the blocks that are not whole blocks of 32 inputs
        c if c == CHECKPOINTS[1] else pytest.param(*c, marks=pytest.mark.slow) for c in CHECKPOINTS
    ],
    ids=str,
)
def test_each_projection_is_its_dequantized_weight_in_8_bit_blocks(model, block, static, tmp_path):
    """Every projection reads as exactly quantize(codes x scale, 8): the same codes, scales and no
    mins, named "fp8 as 8-bit"; with --quantization none's dequantize, as codes x scale itself;
    every other tensor as stored (bfloat16). Static input scales are dropped."""
    fp8_folder, dequantized_folder = _write(tmp_path, model, block, static)
    expected = load_file(dequantized_folder / "model.safetensors")
    stored = load_file(fp8_folder / "model.safetensors")
    ours, as_float = _read(fp8_folder), _read(fp8_folder, dequantize=True)
    assert ours.keys() == as_float.keys() == expected.keys()
    projections = 0
    for name, tensor in expected.items():
        if stored[name].dtype != torch.float8_e4m3fn:
            assert torch.equal(ours[name], stored[name]) and torch.equal(as_float[name], stored[name]), name
            continue
        projections += 1
        held, reference = ours[name], quantize(tensor, 8)
        assert isinstance(held, BlockQuantized) and held.format == FORMAT, name
        assert held.bits == 8 and held.mins is None and not held.per_token
        assert torch.equal(held.q, reference.q) and torch.equal(held.scales, reference.scales), name
        assert as_float[name].dtype == torch.float32 and torch.equal(as_float[name], tensor), name
    assert projections == 2 * len(PROJECTIONS)


def test_rows_chosen_and_joined_before_reading_are_the_same_blocks(tmp_path):
    """A column-parallel share and a fused q/k/v are cut from the file's rows before they are read
    out: the same blocks as cutting the read weights."""
    fp8_folder, _ = _write(tmp_path, "llama-ragged", (128, 128), False)
    ours = _read(fp8_folder)
    layer = "model.layers.0.self_attn"
    q, k, v = (ours[f"{layer}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    share, joined = q.rows(64, 96), join_rows([q, k, v])
    assert share.still_encoded is not None and joined.still_encoded is not None
    assert joined.format == FORMAT and joined.shape == (320, 192)
    assert torch.equal(share.q, q.q[64:160]) and torch.equal(share.scales, q.scales[64:160])
    for part, first in zip((q, k, v), (0, 192, 256), strict=True):
        rows = part.shape[0]
        assert torch.equal(joined.q[first : first + rows], part.q)
        assert torch.equal(joined.scales[first : first + rows], part.scales)


def _top_choice(position: dict) -> int:
    return next(token for token, logprob in position.items() if logprob.rank == 1)


# Kept as 8-bit blocks against the same fp8 weights in float32, teacher-forced over 127 random
# tokens, measured on this host (x86, AVX-512 VNNI): mean / max |logprob difference| and first
# choices the same: Llama (hidden 192) 0.339 / 2.57, 103/127 (per-tensor scales: 0.348 / 1.39,
# 106/127); Qwen3 (hidden 64) 0.061 / 0.36, 115/127. The error is the integer kernel's, not the
# reading's: --quantization int8 on the float checkpoint these were made from scores 0.366 / 2.36,
# 99/127 (Llama) and 0.063 / 0.19, 115/127 (Qwen3), and int8 on the dequantized one scores the
# same as fp8 kept, to the digit (asserted). The tiny random models' logits are peaky (the prompt's
# mean logprob -19.7 for Llama), so one rounding moves them more than a trained model's. Bounds at
# about twice the largest leave room for another CPU's rounding.
@pytest.mark.parametrize(
    ("model", "block", "static"),
    [pytest.param(*CHECKPOINTS[0], marks=pytest.mark.slow), CHECKPOINTS[3]],  # make test-fast: Qwen3's
    ids=str,
)
def test_fp8_checkpoint_served_against_its_weights_in_float(model, block, static, tmp_path):
    """--quantization none: float32 greedy tokens and prompt logprobs equal (1e-4) pagedllm's on
    the dequantized weights written as a float checkpoint, and transformers' tokens on it. Left
    out: the projections in 8-bit blocks for the integer kernel, close to that reference and the
    same as --quantization int8 on the dequantized checkpoint; the start-up line's bytes by format
    as `pagedllm plan` counts them from config.json."""
    from transformers import AutoModelForCausalLM

    fp8_folder, dequantized_folder = _write(tmp_path, model, block, static)
    ids = torch.randint(100, 49000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    runs = {}
    for label, folder, quantization in (
        ("reference", dequantized_folder, None),
        ("none", fp8_folder, "none"),
        ("kept", fp8_folder, None),
        ("int8", dequantized_folder, "int8"),
    ):
        if label == "kept" and not cpu_ops.serves_quant_linear(8, 32, 32):
            break
        engine = LLM(str(folder), **{**TEST_ENGINE_ARGS, "max_model_len": 512, "quantization": quantization})
        output = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        positions = output.prompt_logprobs[1:]
        logprobs = torch.tensor([position[t].logprob for position, t in zip(positions, ids[1:], strict=True)])
        first_choices = [_top_choice(position) for position in positions]
        formats = engine.llm_engine.core.worker.weights_bytes_by_format()
        runs[label] = (output.outputs[0].token_ids, logprobs, first_choices, formats)
        del engine

    reference_model = AutoModelForCausalLM.from_pretrained(dequantized_folder, dtype=torch.float32)
    ref_tokens, ref_logits = hf_greedy(reference_model, ids, 16)
    tokens, logprobs, _, formats = runs["none"]
    assert_greedy_equal(runs["reference"][0], ref_tokens, ref_logits, "float checkpoint")
    assert tokens == runs["reference"][0] and formats.keys() == {"float32"}
    assert float((logprobs - runs["reference"][1]).abs().max()) < 1e-4
    if "kept" not in runs:
        return
    _, logprobs, first_choices, formats = runs["kept"]
    assert FORMAT in formats and "float32" in formats  # embeddings, norms, the LM head
    difference = (logprobs - runs["none"][1]).abs()
    same = sum(a == b for a, b in zip(first_choices, runs["none"][2], strict=True)) / len(first_choices)
    print(model, block, float(difference.mean()), float(difference.max()), same)
    assert float(difference.mean()) < 0.7 and float(difference.max()) < 5.0 and same >= 0.6
    assert float((logprobs - runs["int8"][1]).abs().max()) < 1e-5
    planned = weights_by_format(
        model_config_from_folder(fp8_folder),
        "float32",
        None,
        checkpoint=read_checkpoint_quantization(fp8_folder),
    )
    assert abs(planned[FORMAT] - formats[FORMAT]) <= 0.01 * formats[FORMAT], (planned, formats)


def test_pagedllm_plan_names_the_format_and_the_flag_is_the_checkpoints_own(tmp_path, capsys):
    """`pagedllm plan` on an fp8 folder: its projections as "fp8 as 8-bit" (8.5 bits a weight);
    --quantization fp8 names it, none plans float, int8 is refused on it; fp8 on a float folder
    is refused as awq / gptq / compressed-tensors are."""
    fp8_folder, _ = _write(tmp_path, "qwen3-head-dim", (128, 128), False)
    config = model_config_from_folder(fp8_folder)
    for flags in ([], ["--quantization", "fp8"]):
        main(["plan", "--model", str(fp8_folder), "--dtype", "float32", *flags, "--json"])
        by_format = json.loads(capsys.readouterr().out)["weights_bytes_by_format"]
        assert by_format == {
            FORMAT: config.projection_parameters(1) * 17 // 16,
            "float32": by_format["float32"],
        }
    main(["plan", "--model", str(fp8_folder), "--dtype", "float32"])
    assert f"{FORMAT} " in capsys.readouterr().out
    main(["plan", "--model", str(fp8_folder), "--dtype", "float32", "--quantization", "none", "--json"])
    assert json.loads(capsys.readouterr().out)["weights_bytes_by_format"].keys() == {"float32"}
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(fp8_folder), "--quantization", "int8"])
    assert "fp8 checkpoint is quantized already" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(tmp_path / "float"), "--quantization", "fp8"])
    assert "--quantization fp8: the model's weights are not quantized" in capsys.readouterr().err
    check_quantization("fp8", is_gguf=False, checkpoint_method="fp8")
    with pytest.raises(ValueError, match=r"fp8-quantized \(give --quantization fp8"):
        check_quantization("awq", is_gguf=False, checkpoint_method="fp8")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        check_quantization("gguf", is_gguf=False, checkpoint_method="fp8")


def test_eval_weight_quant_checks_an_fp8_checkpoint_as_stored(tmp_path, capsys):
    """`pagedllm eval weight-quant` on an fp8 folder: one row, fp8 as served, against the file's
    own values in float (--quantization none reads them, not their 8-bit blocks)."""
    import argparse

    from pagedllm.eval import weight_quant

    fp8_folder, _ = _write(tmp_path, "qwen3-head-dim", (128, 128), False)
    parser = argparse.ArgumentParser()
    weight_quant.add_arguments(parser)
    argv = ["--model", str(fp8_folder), "--json", "--max-tokens", "4", "--dtype", "float32"]
    weight_quant.main(parser.parse_args([*argv, "--max-model-len=512"]))
    (row,) = json.loads(capsys.readouterr().out)["formats"]
    assert row["quantization"] == "fp8" and row["all_finite"]
    if cpu_ops.serves_quant_linear(8, 32, 32):  # measured: -0.29% on this host
        assert abs(row["perplexity_relative_diff"]) < 0.05


def test_the_engine_refuses_fp8_on_a_float_checkpoint(tmp_path):
    save_tiny("qwen3-head-dim", tmp_path)
    with pytest.raises((ValueError, ModelLoadError), match="--quantization fp8: the model's weights are not"):
        LLM(str(tmp_path), **{**TEST_ENGINE_ARGS, "max_model_len": 512, "quantization": "fp8"})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fmt": "e5m2"}, "fmt 'e4m3' .* is read, not 'e5m2'"),
        ({"activation_scheme": "per-token"}, "activation_scheme 'dynamic' or 'static', not 'per-token'"),
        (
            {"weight_block_size": [128]},
            r"weight_block_size is two positive integers \[rows, inputs\], not \[128\]",
        ),
        ({"weight_block_size": [128, 0]}, "weight_block_size is two positive integers"),
        ({"weight_block_size": [128.0, 128]}, "weight_block_size is two positive integers"),
        ({"weight_block_size": "128x128"}, "weight_block_size is two positive integers"),
        (
            {"weight_block_size": [128, 128], "activation_scheme": "static"},
            "weight_block_size takes activation_scheme 'dynamic'",
        ),
    ],
)
def test_unread_fp8_configs_are_refused_by_field(config, message, tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8", **config}})
    )
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(tmp_path)


def test_a_config_without_fmt_or_activation_scheme_is_e4m3_dynamic(tmp_path):
    """AutoFP8's configs name no fmt; transformers' default scheme is dynamic."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "FP8"}}))
    quantization = read_checkpoint_quantization(tmp_path)
    assert quantization is not None and quantization.method == "fp8"


def _tensors(weight_dtype=torch.float8_e4m3fn, scale_shape=(1, 1), k=64):
    weight = torch.randn(16, k).to(weight_dtype)
    return [("layer.weight", weight), ("layer.weight_scale_inv", torch.ones(scale_shape))]


@pytest.mark.parametrize(
    ("tensors", "block", "message"),
    [
        (_tensors()[:1], (128, 128), "layer lacks its weight_scale_inv"),
        (_tensors()[1:], (128, 128), "layer lacks its float8 weight"),
        (_tensors(torch.float8_e5m2), (128, 128), "float8_e5m2; float8_e4m3fn is read"),
        (
            _tensors(scale_shape=(1, 2)),
            (128, 128),
            r"blocks of \[128, 128\] takes scales \[1, 1\], not \[1, 2\]",
        ),
        (_tensors(scale_shape=(16, 1)), None, "without weight_block_size"),
    ],
)
def test_unread_fp8_tensors_are_named(tensors, block, message):
    with pytest.raises(ValueError, match=message):
        list(iter_fp8_weights(tensors, block))


def test_inputs_not_whole_blocks_of_32_are_held_as_float():
    weight, scale = _tensors(k=48)
    (name, read), *_ = iter_fp8_weights([weight, scale], (128, 128))
    assert name == "layer.weight" and isinstance(read, torch.Tensor)
    assert torch.equal(read, weight[1].float())
