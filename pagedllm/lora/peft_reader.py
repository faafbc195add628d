"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) as LoRAParts by target.

PEFT names a pair `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` and
`...lora_B.weight`; its scaling is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. What
this reader cannot apply exactly is refused by name rather than half applied: DoRA, trained
biases, modules_to_save (whole replaced layers), per-module ranks or alphas, Conv1D's
fan_in_fan_out. A pickled adapter_model.bin is never unpickled (it could run code).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

from pagedllm.lora.adapter import LoRAError, LoRAPart

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?(layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight"
)


def is_peft_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_peft(folder: Path) -> dict[str, LoRAPart]:
    """Raises LoRAError naming the folder and what in it cannot be served."""
    config = _read_config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{folder}/{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"{folder}/{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = " (adapter_model.bin is a pickle, which pagedllm does not load: save with safetensors)"
        raise LoRAError(
            f"{folder}: no {WEIGHTS_FILE}{pickled if (folder / 'adapter_model.bin').exists() else ''}"
        )
    pairs: dict[str, dict[str, Any]] = {}
    try:
        with safe_open(str(weights), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.fullmatch(key)
                if match is None:
                    raise LoRAError(
                        f"{weights}: tensor {key!r} is not a LoRA pair of a decoder layer's projection "
                        "(embeddings, the LM head and other modules cannot be adapted here)"
                    )
                pairs.setdefault(match.group(1), {})[match.group(2)] = file.get_tensor(key)
    except LoRAError:
        raise
    except Exception as error:  # a damaged or hostile file: safetensors' own message
        raise LoRAError(f"{weights}: cannot be read ({error})") from error
    parts = {}
    for target, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{weights}: {target} has lora_{next(iter(pair))} without its other half")
        if pair["A"].dim() != 2 or pair["A"].shape[0] != rank:
            raise LoRAError(f"{weights}: {target}: lora_A {tuple(pair['A'].shape)} is not of rank r={rank}")
        parts[target] = LoRAPart(pair["A"], pair["B"], scaling)
    return parts


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAError(f"{path}: over {MAX_CONFIG_BYTES:,} bytes, not an adapter config")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise LoRAError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise LoRAError(f"{path}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    refusals = {
        "peft_type": (peft_type != "LORA", f"{peft_type!r}: only LORA adapters are served"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not served"),
        "bias": (
            config.get("bias", "none") != "none",
            "trained biases are not applied; train with bias='none'",
        ),
        "modules_to_save": (bool(config.get("modules_to_save")), "whole replaced modules are not served"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks are not served"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not served"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "Conv1D layouts are not served"),
        "alora_invocation_tokens": (
            bool(config.get("alora_invocation_tokens")),
            "activated LoRA (from an invocation sequence on) is not served",
        ),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise LoRAError(f"{path}: {key}: {why}")
    return config
