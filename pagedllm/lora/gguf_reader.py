"""A llama.cpp GGUF LoRA file (convert_lora_to_gguf.py's) as LoRAParts by target.

The file says `general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha`; each pair is
`blk.N.attn_q.weight.lora_a` ([r, in] as a checkpoint holds it) and `...lora_b` ([out, r]), in
F32, F16, BF16 or Q8_0. llama.cpp scales by alpha / r (alpha 0 or absent: by 1), and its converter
permuted the rows of Llama's Q and K (so lora_b's rows) for its rotary layout, as it does for the
base weights: they are put back in Hugging Face's order, as the base model's are.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from pagedllm.lora.adapter import LoRAError, LoRAPart
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import ModelLoadError
from pagedllm.model.gguf_convert import hf_tensor_name, unpermute_rotary_rows
from pagedllm.model.gguf_file import read_gguf
from pagedllm.model.registry import MODELS

PERMUTED = "llama"
"""The GGUF architecture whose Q and K rows llama.cpp's converter permutes."""


def is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def read_gguf_lora(path: Path, config: ModelConfig) -> dict[str, LoRAPart]:
    """Raises LoRAError naming the file and what in it cannot be served."""
    try:
        contents = read_gguf(path)
    except ModelLoadError as error:
        raise LoRAError(str(error)) from error
    metadata = contents.metadata
    if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
        raise LoRAError(f"{path}: not a LoRA adapter (general.type {metadata.get('general.type')!r})")
    if (
        "adapter.alora.invocation_tokens" in contents.array_lengths
        or "adapter.alora.invocation_tokens" in metadata
    ):
        raise LoRAError(f"{path}: an activated LoRA (from an invocation sequence on), which is not served")
    arch = metadata.get("general.architecture")
    entry = MODELS.get(config.architecture)
    expected = (entry.gguf_architecture if entry else None) or PERMUTED
    if arch != expected:
        raise LoRAError(f"{path}: an adapter for {arch!r} models; this model is {expected!r}")
    alpha = metadata.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or not np.isfinite(alpha):
        raise LoRAError(f"{path}: adapter.lora.alpha must be a number, got {alpha!r}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in contents.tensors:
        base, _, half = tensor.name.rpartition(".")
        if half not in ("lora_a", "lora_b") or len(tensor.shape) != 2:
            raise LoRAError(f"{path}: tensor {tensor.name!r} is not a LoRA pair of a projection")
        try:
            name = hf_tensor_name(base, config.architecture, path)
        except ModelLoadError as error:
            raise LoRAError(str(error)) from error
        target = name.removeprefix("model.").removesuffix(".weight")
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as error:
            raise LoRAError(
                f"{path}: tensor {tensor.name!r}: cannot read {tensor.tensor_type.name}"
            ) from error
        shape = tuple(int(d) for d in reversed(tensor.shape))
        pairs.setdefault(target, {})[half] = torch.from_numpy(
            np.array(values, dtype=np.float32).reshape(shape)
        )
    parts = {}
    for target, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise LoRAError(f"{path}: {target} has {next(iter(pair))} without its other half")
        a, b = pair["lora_a"], pair["lora_b"]
        rank = a.shape[0]
        if arch == PERMUTED and target.endswith(("q_proj", "k_proj")) and b.shape[0] % 2 == 0:
            heads = config.num_attention_heads if target.endswith("q_proj") else config.num_key_value_heads
            if b.shape[0] % (2 * heads) == 0:
                b = b[torch.from_numpy(unpermute_rotary_rows(np.arange(b.shape[0]), heads))]
        parts[target] = LoRAPart(a, b, alpha / rank if alpha else 1.0)
    return parts
