"""AWQ, GPTQ and compressed-tensors checkpoints: their integer weights read without loss, served
quantized, and a tiny model written in each against transformers on the same weights dequantized.

The checkpoints are written here from the formats' definitions (numpy bit loops, one per format's
packing), not by the code under test: W = scale * (code - zero) per group of inputs."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization import BlockQuantized
from pagedllm.model.checkpoint_quant import iter_checkpoint_weights
from pagedllm.model.config_reader import model_config_from_folder
from pagedllm.model_loader import check_quantization
from pagedllm.planner import weights_by_format
from pagedllm.quantization.registry import read_checkpoint_quantization

from ..helpers import TEST_ENGINE_ARGS, assert_greedy_equal, hf_greedy, save_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Format:
    """One checkpoint format as a test writes it."""

    name: str
    bits: int
    group_size: int  # -1: a row
    symmetric: bool
    act_order: bool = False

    @property
    def method(self) -> str:
        return {"awq": "awq", "gptq": "gptq", "gptq_v2": "gptq"}.get(self.name, "compressed-tensors")

    def quantization_config(self) -> dict:
        if self.name == "awq":
            return {
                "quant_method": "awq",
                "bits": 4,
                "group_size": self.group_size,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": None,
            }
        if self.name in ("gptq", "gptq_v2"):
            return {
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group_size,
                "desc_act": self.act_order,
                "sym": self.symmetric,
                "checkpoint_format": self.name,
            }
        strategy = "group" if self.group_size > 0 else "channel"
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": strategy,
            "group_size": self.group_size if self.group_size > 0 else None,
        }
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized" if self.name == "ct-packed" else "int-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations if self.bits == 8 else None,
                }
            },
            "ignore": ["lm_head"],
        }


FORMATS = [
    Format("awq", 4, 32, symmetric=False),
    Format("gptq", 4, 32, symmetric=True),
    Format("gptq_v2", 8, -1, symmetric=False),
    Format("ct-packed", 4, 32, symmetric=True),
    Format("ct-packed", 4, 32, symmetric=False),
    Format("ct-int", 8, -1, symmetric=True),  # W8A8: int8 per channel
]


def _quantize(weight: torch.Tensor, fmt: Format, rng: np.random.Generator):
    """Codes [N, K] (0 .. 2^bits - 1), scales (float16; bfloat16 for compressed-tensors, which
    stores them in the model's dtype) and integer zeros [N, groups], each input's group, and the
    dequantized weight (float32): scale * (code - zero)."""
    n, k = weight.shape
    group = k if fmt.group_size == -1 else fmt.group_size
    top = 2**fmt.bits - 1
    w = weight.double().numpy().reshape(n, k // group, group)
    if fmt.symmetric:
        scales = np.abs(w).max(-1) / (2 ** (fmt.bits - 1) - 1)
        zeros = np.full(scales.shape, 2 ** (fmt.bits - 1))
    else:
        low, high = w.min(-1), w.max(-1)
        scales = (high - low) / top
        zeros = np.clip(np.round(-low / scales), 0, top)
    scale_dtype = torch.float16 if fmt.method in ("awq", "gptq") else torch.bfloat16
    scales = torch.from_numpy(scales).to(scale_dtype).double().numpy()
    codes = np.clip(np.round(w / scales[..., None]) + zeros[..., None], 0, top).astype(np.int64).reshape(n, k)
    groups_of_inputs = np.arange(k) // group
    if fmt.act_order:  # the inputs' groups in a shuffled order, as GPTQ's desc_act leaves them
        groups_of_inputs = rng.permutation(groups_of_inputs)
    dequantized = scales[:, groups_of_inputs] * (codes - zeros[:, groups_of_inputs])
    stored_scales = torch.from_numpy(scales).to(scale_dtype)
    return codes, stored_scales, zeros.astype(np.int64), groups_of_inputs, torch.tensor(dequantized).float()


def _pack_words(values: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """int32 words of 32 / bits values along `axis`, value j of each word in bits j*bits up;
    `order`: which of each run of 32 / bits values word slot j holds (AWQ's interleave)."""
    per_word = 32 // bits
    values = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((values.shape[0] // per_word, *values.shape[1:]), dtype=np.uint32)
    for slot in range(per_word):
        words |= values[(order[slot] if order else slot) :: per_word] << np.uint32(bits * slot)
    return torch.from_numpy(np.moveaxis(words, 0, axis).view(np.int32).copy())


def _checkpoint_tensors(module: str, codes, scales, zeros, groups_of_inputs, fmt: Format) -> dict:
    """One projection's tensors as the format stores them (codes [N, K] -> the file's layout)."""
    half = 2 ** (fmt.bits - 1)
    if fmt.name == "awq":
        awq_order = [0, 2, 4, 6, 1, 3, 5, 7]
        return {
            f"{module}.qweight": _pack_words(codes.T, 4, axis=1, order=awq_order),
            f"{module}.qzeros": _pack_words(zeros.T, 4, axis=1, order=awq_order),
            f"{module}.scales": scales.T.contiguous(),
        }
    if fmt.name in ("gptq", "gptq_v2"):
        stored_zeros = zeros - 1 if fmt.name == "gptq" else zeros  # v1 stores each zero minus one
        stored_zeros = stored_zeros & (2**fmt.bits - 1)
        return {
            f"{module}.qweight": _pack_words(codes.T, fmt.bits, axis=0),
            f"{module}.qzeros": _pack_words(stored_zeros.T, fmt.bits, axis=1),
            f"{module}.scales": scales.T.contiguous(),
            f"{module}.g_idx": torch.from_numpy(groups_of_inputs.astype(np.int32)),
        }
    signed = codes - half
    tensors = {f"{module}.weight_scale": scales}
    if fmt.name == "ct-packed":
        tensors[f"{module}.weight_packed"] = _pack_words(codes, fmt.bits, axis=1)  # codes offset by half
        tensors[f"{module}.weight_shape"] = torch.tensor(codes.shape)
    else:
        tensors[f"{module}.weight"] = torch.from_numpy(signed.astype(np.int8))
        tensors[f"{module}.input_scale"] = torch.ones(1)
    if not fmt.symmetric:
        tensors[f"{module}.weight_zero_point"] = torch.from_numpy((zeros - half).astype(np.int8))
    return tensors


def write_quantized_checkpoint(float_folder, quantized_folder, dequantized_folder, fmt: Format) -> None:
    """A float checkpoint's projections quantized in `fmt` (quantized_folder), and the same
    weights dequantized as a float checkpoint (dequantized_folder), the reference's."""
    rng = np.random.default_rng(0)
    tensors = load_file(float_folder / "model.safetensors")
    quantized, dequantized = {}, dict(tensors)
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS):
            quantized[name] = tensor
            continue
        codes, scales, zeros, groups, weight = _quantize(tensor, fmt, rng)
        quantized.update(_checkpoint_tensors(module, codes, scales, zeros, groups, fmt))
        dequantized[name] = weight
    for folder, weights in ((quantized_folder, quantized), (dequantized_folder, dequantized)):
        folder.mkdir(exist_ok=True)
        for file in float_folder.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, folder)
        save_file(weights, folder / "model.safetensors")
    config = json.loads((quantized_folder / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config()
    (quantized_folder / "config.json").write_text(json.dumps(config))


def _read_back(folder) -> dict[str, torch.Tensor | BlockQuantized]:
    """The checkpoint's weights as the loader reads them."""
    quantization = read_checkpoint_quantization(folder)
    assert quantization is not None
    weights = iter_checkpoint_weights(load_file(folder / "model.safetensors").items(), quantization)
    return dict(weights)


HELD_AS_FLOAT = [
    Format("gptq", 4, 32, symmetric=False, act_order=True),  # groups that are not runs of inputs
    Format("ct-int", 8, 16, symmetric=True),  # groups of half a block
]


@pytest.mark.parametrize("fmt", FORMATS + HELD_AS_FLOAT, ids=str)
def test_checkpoint_weights_read_without_loss(fmt, tmp_path):
    """Every projection reads back as exactly scale * (code - zero), in each format: kept in
    blocks, or as a float weight where its groups are not runs of whole blocks."""
    save_tiny_model("qwen2-bias", tmp_path / "float")
    write_quantized_checkpoint(tmp_path / "float", tmp_path / "quantized", tmp_path / "dequantized", fmt)
    expected = load_file(tmp_path / "dequantized" / "model.safetensors")
    ours = _read_back(tmp_path / "quantized")
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        weight = ours[name].dequantize() if isinstance(ours[name], BlockQuantized) else ours[name]
        assert torch.equal(weight.float(), tensor.float()), name
    quantized = {name for name, weight in ours.items() if isinstance(weight, BlockQuantized)}
    assert len(quantized) == (0 if fmt in HELD_AS_FLOAT else 2 * len(PROJECTIONS)), quantized
    # W8A8's dynamic per-token activations (int8 per channel, symmetric) are computed as such
    w8a8 = fmt.name == "ct-int" and fmt.group_size == -1 and fmt.symmetric
    assert all(ours[name].per_token == w8a8 for name in quantized)


# The mean / max |logprob difference| kept quantized against dequantized, over 4 tiny models
# (Qwen2, Llama 3, Mistral, Qwen3) in AWQ, GPTQ and W8A8: 0.04-0.11 / 0.13-0.70. Bounds at about
# twice the largest leave room for another CPU's rounding.
@pytest.mark.parametrize(
    "fmt", [FORMATS[0], pytest.param(FORMATS[5], marks=pytest.mark.slow)], ids=str
)  # make test-fast keeps AWQ
def test_quantized_checkpoint_served_matches_transformers_on_its_weights(fmt, tmp_path):
    """An AWQ and a W8A8 checkpoint of a tiny random Qwen2: dequantized at load (--quantization
    none), float32 greedy tokens equal transformers' on the same weights; kept quantized (the
    integer kernel, activations rounded to 8 bits per block of 32, per token for W8A8), its prompt
    logprobs stay close to that run's."""
    from transformers import AutoModelForCausalLM

    save_tiny_model("qwen2-bias", tmp_path / "float")
    write_quantized_checkpoint(tmp_path / "float", tmp_path / "quantized", tmp_path / "dequantized", fmt)
    reference_model = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32)
    ids = list(range(100, 160))
    ref_tokens, ref_logits = hf_greedy(reference_model, ids, 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    runs = {}
    for quantization in ("none", None):
        if quantization is None and not cpu_ops.serves_quant_linear(fmt.bits, 32, 32):
            break
        engine = LLM(
            str(tmp_path / "quantized"),
            **{**TEST_ENGINE_ARGS, "max_model_len": 512, "quantization": quantization},
        )
        output = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        logprobs = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i])
        runs[quantization] = (
            output.outputs[0].token_ids,
            logprobs,
            engine.llm_engine.core.worker.weights_bytes_by_format(),
        )
        del engine
    tokens, _, formats = runs["none"]
    assert_greedy_equal(tokens, ref_tokens, ref_logits, str(fmt))
    assert formats.keys() == {"float32"}
    if None in runs:
        tokens, logprobs, formats = runs[None]
        assert f"{fmt.method} int{fmt.bits}" in formats
        difference = (logprobs - runs["none"][1]).abs()
        print(fmt, float(difference.mean()), float(difference.max()))
        assert float(difference.mean()) < 0.2 and float(difference.max()) < 1.2
        # `pagedllm plan` counts the bytes the kernel holds, from config.json alone
        folder = tmp_path / "quantized"
        planned = weights_by_format(
            model_config_from_folder(folder), "float32", None, checkpoint=read_checkpoint_quantization(folder)
        )
        name = f"{fmt.method} int{fmt.bits}"
        assert abs(planned[name] - formats[name]) <= 0.01 * formats[name], (planned, formats)


@pytest.mark.slow  # eval over a checkpoint; the fast set keeps the FP8 one's
def test_eval_weight_quant_checks_a_checkpoint_as_stored(tmp_path, capsys):
    """`pagedllm eval weight-quant` on an AWQ folder: the checkpoint as served against the same
    weights dequantized, one row named by its method (int8/int4 would be refused on it)."""
    import argparse

    from pagedllm.eval import weight_quant

    save_tiny_model("qwen2-bias", tmp_path / "float")
    folder = tmp_path / "quantized"
    write_quantized_checkpoint(tmp_path / "float", folder, tmp_path / "dequantized", FORMATS[0])
    parser = argparse.ArgumentParser()
    weight_quant.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(folder), "--json", "--max-tokens", "4", "--dtype", "float32", "--max-model-len=512"]
    )
    weight_quant.main(args)
    report = json.loads(capsys.readouterr().out)
    (row,) = report["formats"]
    assert row["quantization"] == "awq" and row["all_finite"]
    if cpu_ops.serves_quant_linear(4, 32, 32):  # kept 4-bit (the float32 embedding is most bytes)
        assert row["weights_ratio"] < 1 and abs(row["perplexity_relative_diff"]) < 0.1


def test_quantization_flag_names_the_checkpoints_own_method():
    check_quantization("awq", is_gguf=False, checkpoint_method="awq")
    check_quantization(None, is_gguf=False, checkpoint_method="gptq")
    check_quantization("none", is_gguf=False, checkpoint_method="compressed-tensors")
    with pytest.raises(ValueError, match=r"awq-quantized \(give --quantization awq"):
        check_quantization("gptq", is_gguf=False, checkpoint_method="awq")
    with pytest.raises(ValueError, match="not quantized"):
        check_quantization("awq", is_gguf=False)
    with pytest.raises(ValueError, match="awq checkpoint is quantized already"):
        check_quantization("int4", is_gguf=False, checkpoint_method="awq")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
        ({"quant_method": "gptq", "bits": 3}, "4 or 8 bits"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
            },
            "integer weights",
        ),
    ],
)
def test_unread_quantization_configs_are_refused_by_name(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(tmp_path)


def test_a_projection_missing_a_part_is_named(tmp_path):
    fmt = FORMATS[0]
    save_tiny_model("qwen2-bias", tmp_path / "float")
    write_quantized_checkpoint(tmp_path / "float", tmp_path / "quantized", tmp_path / "dequantized", fmt)
    tensors = load_file(tmp_path / "quantized" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    quantization = read_checkpoint_quantization(tmp_path / "quantized")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj lacks qzeros"):
        list(iter_checkpoint_weights(tensors.items(), quantization))
