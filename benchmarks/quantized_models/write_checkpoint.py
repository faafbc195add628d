"""Write an AWQ, GPTQ or compressed-tensors W8A8 checkpoint with random weights in the shape of a
real model, for speed benchmarks against vLLM on the same files.

    .venv/bin/python benchmarks/quantized_models/write_checkpoint.py --shape llama-1b --format awq --out DIR

Formats, as the tools users quantize with write them (a Hugging Face folder: config.json with its
quantization_config, model.safetensors, the tokenizer):
- awq: AutoAWQ's GEMM layout, 4 bits, groups of 128, zero points;
- gptq: AutoGPTQ's (checkpoint format gptq), 4 bits symmetric, groups of 128, no act order;
- w8a8: compressed-tensors int-quantized, int8 per output channel, activations int8 per token
  (dynamic), as llm-compressor's W8A8 recipe writes it.

Random codes, scales and zeros (fixed seed) time as real ones do: every projection has the real
model's shape and every step reads the real number of bytes; the text they produce is noise. The
shapes and the 49,152-token SmolLM2 vocabulary (tokenizer files copied from the default model) are
write_gguf.py's; the embedding (tied LM head) is bfloat16, as these tools leave it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_gguf import SHAPES, Shape

VOCAB_SIZE = 49152
GROUP_SIZE = 128
FORMATS = ("awq", "gptq", "w8a8")


def quantization_config(fmt: str) -> dict:
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP_SIZE,
            "zero_point": True,
            "version": "gemm",
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP_SIZE,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def random_words(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """int32 words of uniformly random bits: uniformly random 4-bit codes."""
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator)


def random_scales(*shape: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Steps of about what N(0, 0.02) weights get at 4 bits in groups of 128."""
    return (0.004 + 0.004 * torch.rand(shape, generator=generator)).to(dtype)


def projection(fmt: str, name: str, n: int, k: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One projection W[n, k] in `fmt`, under its Hugging Face module name."""
    groups = k // GROUP_SIZE
    if fmt == "awq":
        return {
            f"{name}.qweight": random_words(k, n // 8, generator=generator),
            f"{name}.qzeros": random_words(groups, n // 8, generator=generator),
            f"{name}.scales": random_scales(groups, n, dtype=torch.float16, generator=generator),
        }
    if fmt == "gptq":  # symmetric: every zero 8, stored as 7 in each nibble
        return {
            f"{name}.qweight": random_words(k // 8, n, generator=generator),
            f"{name}.qzeros": torch.full((groups, n // 8), 0x77777777, dtype=torch.int32),
            f"{name}.scales": random_scales(groups, n, dtype=torch.float16, generator=generator),
            f"{name}.g_idx": (torch.arange(k) // GROUP_SIZE).to(torch.int32),
        }
    return {
        f"{name}.weight": torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator),
        f"{name}.weight_scale": random_scales(n, 1, dtype=torch.bfloat16, generator=generator) / 8,
    }


def checkpoint_tensors(shape: Shape, fmt: str, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h, q_dim = shape.hidden_size, shape.num_attention_heads * shape.head_dim
    kv_dim, inter = shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    tensors = {
        "model.embed_tokens.weight": (0.02 * torch.randn(VOCAB_SIZE, h, generator=generator)).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for i in range(shape.num_hidden_layers):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[f"{layer}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if shape.has_qk_norm:
            for norm in ("q_norm", "k_norm"):
                tensors[f"{layer}.self_attn.{norm}.weight"] = torch.ones(shape.head_dim, dtype=torch.bfloat16)
        for name, n, k in (
            ("self_attn.q_proj", q_dim, h),
            ("self_attn.k_proj", kv_dim, h),
            ("self_attn.v_proj", kv_dim, h),
            ("self_attn.o_proj", h, q_dim),
            ("mlp.gate_proj", inter, h),
            ("mlp.up_proj", inter, h),
            ("mlp.down_proj", h, inter),
        ):
            tensors.update(projection(fmt, f"{layer}.{name}", n, k, generator))
    return tensors


def model_config(shape: Shape, fmt: str) -> dict:
    architecture = "Qwen3ForCausalLM" if shape.arch == "qwen3" else "LlamaForCausalLM"
    return {
        "architectures": [architecture],
        "model_type": "qwen3" if shape.arch == "qwen3" else "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": 8192,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16" if fmt in ("awq", "gptq") else "bfloat16",
        "quantization_config": quantization_config(fmt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from pagedllm.model.gguf_convert import converted_folder
    from pagedllm.model.locate import default_model_path

    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(SHAPES[args.shape], args.format, args.seed), args.out / "model.safetensors")
    (args.out / "config.json").write_text(json.dumps(model_config(SHAPES[args.shape], args.format), indent=2))
    for file in converted_folder(default_model_path()).glob("tokenizer*"):
        shutil.copy(file, args.out)
    size = (args.out / "model.safetensors").stat().st_size
    print(
        f"wrote {args.out} ({args.shape}, {args.format}): {size / 1e6:,.1f} MB "
        f"in {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
