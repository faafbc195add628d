"""A llama.cpp GGUF LoRA file serves as its PEFT source does: the file written here as
llama.cpp's convert_lora_to_gguf.py writes one (general.type adapter, adapter.lora.alpha, pairs
`blk.N.<tensor>.weight.lora_a` / `.lora_b`, Llama's Q and K rows in llama.cpp's rotary order),
its greedy tokens and logprobs equal to the PEFT folder's under transformers + PEFT."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LoRARequest

from .helpers import base_model, peft_greedy, random_adapter
from .test_lora_generation import NEW_TOKENS, PROMPTS, assert_equal, engine, run

GGUF_NAMES = {  # llama.cpp's tensor names for the checkpoint's projections
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: Q and K rows for llama.cpp's rotary."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf_lora(peft_folder, base_folder, path, arch: str, dtype=np.float32, extra=None):
    config = json.loads((base_folder / "config.json").read_text())
    adapter = json.loads((peft_folder / "adapter_config.json").read_text())
    tensors = load_file(str(peft_folder / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter["lora_alpha"]))
    for key, value in (extra or {}).items():
        writer.add_array(key, value)
    for name, a in sorted(tensors.items()):
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        layer = int(name.split("layers.")[1].split(".")[0])
        projection = ".".join(name.split(".lora_A.")[0].split(".")[-2:])
        if arch == "llama" and projection == "self_attn.q_proj":
            b = llama_cpp_permute(b, config["num_attention_heads"], config["num_attention_heads"])
        elif arch == "llama" and projection == "self_attn.k_proj":
            b = llama_cpp_permute(b, config["num_attention_heads"], config["num_key_value_heads"])
        stem = f"blk.{layer}.{GGUF_NAMES[projection]}.weight"
        writer.add_tensor(f"{stem}.lora_a", a.numpy().astype(dtype))
        writer.add_tensor(f"{stem}.lora_b", b.numpy().astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_gguf_lora_equals_its_peft_source(kind, tmp_path):
    base = tmp_path / "base"
    base_model(kind, base)
    peft_folder = random_adapter(base, tmp_path / "peft", 8, seed=11)
    f32 = write_gguf_lora(peft_folder, base, tmp_path / "adapter-f32.gguf", kind)
    f16 = write_gguf_lora(peft_folder, base, tmp_path / "adapter-f16.gguf", kind, np.float16)
    llm = engine(base, max_loras=2)
    try:
        theirs = peft_greedy(base, peft_folder, PROMPTS, NEW_TOKENS)
        assert_equal(run(llm, PROMPTS, [LoRARequest("peft", 1, str(peft_folder))] * 3), theirs, "peft")
        assert_equal(run(llm, PROMPTS, [LoRARequest("gguf", 2, str(f32))] * 3), theirs, "gguf f32")
        half = run(llm, PROMPTS, [LoRARequest("gguf-f16", 3, str(f16))] * 3)
        assert [tokens for tokens, _ in half] == [tokens for tokens, _ in theirs], "gguf f16"
        activated = write_gguf_lora(
            peft_folder,
            base,
            tmp_path / "alora.gguf",
            kind,
            extra={gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS: [5, 6]},
        )
        with pytest.raises(ValueError, match="activated LoRA"):
            run(llm, PROMPTS[:1], [LoRARequest("alora", 4, str(activated))])
        wrong = write_gguf_lora(peft_folder, base, tmp_path / "wrong.gguf", "qwen2")
        with pytest.raises(ValueError, match="an adapter for 'qwen2' models"):
            run(llm, PROMPTS[:1], [LoRARequest("wrong", 5, str(wrong))])
    finally:
        llm.shutdown()
