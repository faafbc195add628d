"""Write the embedded default model (a Q4_1 GGUF) as a plain Hugging Face folder that both vLLM
and pagedllm load: config.json, model.safetensors in the requested dtype, tokenizer files and the
chat template.

    .venv/bin/python benchmarks/vllm_compare/write_hf_model.py OUT_DIR [--dtype bfloat16|float32]

It reuses pagedllm's own GGUF reading (`converted_folder` for the config and the tokenizer saved
from the GGUF metadata; `iter_gguf_weights` for the weights, dequantized to float32 exactly as
transformers does, Q/K rows un-permuted) and only casts the weights and records the dtype in
config.json. Nothing is rewritten when OUT_DIR already holds
the same dtype.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm.layers.quantization import BlockQuantized
from pagedllm.model.config_reader import GGUF_SOURCE, model_config_from_folder
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.gguf_weights import iter_gguf_weights
from pagedllm.model.locate import default_model_path

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def write_hf_model(out_dir: Path, dtype: str) -> Path:
    config_path = out_dir / "config.json"
    if config_path.exists() and json.loads(config_path.read_text()).get("torch_dtype") == dtype:
        return out_dir
    gguf_path = default_model_path()
    source = converted_folder(gguf_path)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for file in source.iterdir():
        if file.name not in (GGUF_SOURCE, "config.json"):
            shutil.copy2(file, staging / file.name)
    tensors = {
        name: (weight.dequantize() if isinstance(weight, BlockQuantized) else weight).to(DTYPES[dtype])
        for name, weight in iter_gguf_weights(gguf_path, model_config_from_folder(source))
    }
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    # transformers 4.x reads torch_dtype, 5.x dtype; vLLM's --dtype auto follows it
    config |= {"torch_dtype": dtype, "dtype": dtype}
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    print(write_hf_model(args.out_dir.resolve(), args.dtype))


if __name__ == "__main__":
    main()
