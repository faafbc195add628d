"""Tiny random base models and random PEFT adapters for them, and transformers + PEFT's greedy
tokens under an adapter (applied as PEFT applies it, not merged): the LoRA tests' reference."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..helpers import TINY, save_with_random_norms

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(kind: str, folder: Path):
    """A random tiny Llama or Qwen3 saved in `folder` (SmolLM2's tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config = (
        LlamaConfig(**TINY, tie_word_embeddings=False)
        if kind == "llama"
        else Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)
    )
    torch.manual_seed(0)
    return save_with_random_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32), folder)


def random_adapter(
    base_folder: Path,
    folder: Path,
    rank: int,
    seed: int,
    *,
    alpha: float | None = None,
    rslora: bool = False,
    targets: list[str] | None = None,
) -> Path:
    """A PEFT LoRA of `rank` on the model in `base_folder`, both halves random (PEFT starts B at
    zero), saved in `folder` as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        use_rslora=rslora,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5 / math.sqrt(param.shape[1]))
    model.save_pretrained(folder)
    return folder


@torch.inference_mode()
def peft_greedy(
    base_folder: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs for each prompt, under the adapter as PEFT
    applies it (the base weights untouched), or the base model alone (adapter None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    results = []
    for prompt in prompts:
        ids, tokens, logprobs = list(prompt), [], []
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
        results.append((tokens, logprobs))
    return results
