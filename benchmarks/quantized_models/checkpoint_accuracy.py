"""What AWQ, GPTQ and W8A8 checkpoints cost in quality on real weights: the default model's
(SmolLM2-135M-Instruct, read from its Q4_1 GGUF by transformers, float32) written in each format
by round to nearest, then `pagedllm eval weight-quant` on each folder (perplexity and greedy
agreement against the same folder dequantized).

    .venv/bin/python benchmarks/quantized_models/checkpoint_accuracy.py --out DIR [--dtype float32]

The folders are written by the test suite's packers (tests/quantization/test_checkpoint_quant.py): AWQ with
zero points and GPTQ symmetric, 4 bits in groups of 64 (the model's 576 inputs are not whole
groups of 128), and W8A8 (int8 per channel) twice: as llm-compressor writes it, activations
quantized per token (the kernel's per-token mode, as vLLM computes it), and with its
input_activations taken out of config.json, which leaves them to the kernel's rounding per block
of 32. Round to nearest with no calibration (no SmoothQuant, no GPTQ solver): the worst case a
scheme meets, not what a calibrated checkpoint of it gives.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.quantization.test_checkpoint_quant import Format, write_quantized_checkpoint  # noqa: E402

FORMATS = {
    "w8a8": Format("ct-int", 8, -1, symmetric=True),
    "awq": Format("awq", 4, 64, symmetric=False),
    "gptq": Format("gptq", 4, 64, symmetric=True),
}


def write_float_folder(out: Path) -> None:
    """The default model as a float32 Hugging Face folder, with its tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pagedllm.model.gguf_convert import converted_folder
    from pagedllm.model.locate import default_model_path

    gguf_path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    out.mkdir(parents=True)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for file in converted_folder(gguf_path).iterdir():
        if file.name.startswith("tokenizer") or file.name == "chat_template.jinja":
            shutil.copy(file, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    write_float_folder(args.out / "float")
    folders = []
    for name, fmt in FORMATS.items():
        folder = args.out / name
        write_quantized_checkpoint(args.out / "float", folder, args.out / f"{name}-dequantized", fmt)
        for file in (args.out / "float").iterdir():
            if file.suffix != ".safetensors" and file.name != "config.json":
                shutil.copy(file, folder)
        folders.append(folder)
    per_block = args.out / "w8a8-per-block"
    shutil.copytree(args.out / "w8a8", per_block)
    config = json.loads((per_block / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (per_block / "config.json").write_text(json.dumps(config, indent=1))
    folders.insert(1, per_block)
    for folder in folders:
        print(f"== {folder.name}", flush=True)
        command = [str(REPO / ".venv/bin/pagedllm"), "eval", "weight-quant", "--model", str(folder)]
        subprocess.run([*command, "--dtype", args.dtype], check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
