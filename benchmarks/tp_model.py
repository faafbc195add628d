"""A random Llama whose heads split over 2 ranks, for `bench throughput --tensor-parallel-size`.

The default model (SmolLM2-135M: 9 heads, 3 KV heads) splits only over 3 ranks, so the tensor-
parallel figures in docs/scaling.md use this one: SmolLM2-135M's size and depth (30 layers,
intermediate 1536, vocabulary 49,152, tied embeddings) with 8 heads of 64 and 4 KV heads.
Random weights change no timing (EOS is ignored in the workloads).

    python benchmarks/tp_model.py /tmp/tp-model
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.locate import default_model_path

SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def main(folder: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for file in converted_folder(default_model_path()).glob("tokenizer*"):
        shutil.copy(file, folder)  # SmolLM2's tokenizer, so the workloads tokenize as usual
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters in {folder}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
