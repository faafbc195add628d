"""Reading an adapter from where a LoRARequest says it lives, and the worker's cache of read ones."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from pagedllm.lora.adapter import Adapter, LoRAError, build_adapter
from pagedllm.lora.gguf_reader import is_gguf_file, read_gguf_lora
from pagedllm.lora.peft_reader import CONFIG_FILE, WEIGHTS_FILE, is_peft_folder, read_peft
from pagedllm.lora.targets import lora_targets
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig


def adapter_fingerprint(path: str) -> str:
    """A hash of the files an adapter is read from (a PEFT folder's config and weights, or the
    GGUF file), 128 bits of sha256 in hex."""
    location = Path(path).expanduser()
    files = [location / CONFIG_FILE, location / WEIGHTS_FILE] if location.is_dir() else [location]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def read_adapter(request: LoRARequest, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> Adapter:
    """The adapter at request.lora_path (a PEFT folder or a GGUF LoRA file), checked against the
    model of `config`. Raises LoRAError saying what is wrong, FileNotFoundError naming the path."""
    path = Path(request.lora_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{request.lora_path}: no such adapter folder or file")
    if is_peft_folder(path):
        parts = read_peft(path)
    elif is_gguf_file(path):
        parts = read_gguf_lora(path, config)
    else:
        raise LoRAError(
            f"{request.lora_path}: neither a PEFT folder (adapter_config.json, adapter_model.safetensors) "
            "nor a GGUF LoRA file"
        )
    targets = lora_targets(config)
    return build_adapter(
        request.lora_name, request.lora_int_id, request.lora_path, parts, targets, max_rank, dtype
    )


class AdapterCache:
    """Adapters read into memory, by id: at most `capacity` (--max-cpu-loras), the least recently
    used let go first (read again from their path if asked for later). Thread-safe."""

    def __init__(self, config: ModelConfig, max_rank: int, dtype: torch.dtype, capacity: int) -> None:
        self.config = config
        self.max_rank = max_rank
        self.dtype = dtype
        self.capacity = capacity
        self._adapters: OrderedDict[int, Adapter] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, request: LoRARequest) -> Adapter:
        with self._lock:
            adapter = self._adapters.get(request.lora_int_id)
            if adapter is not None and adapter.name == request.lora_name:
                self._adapters.move_to_end(request.lora_int_id)
                return adapter
        adapter = read_adapter(request, self.config, self.max_rank, self.dtype)
        with self._lock:
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        return adapter

    def remove(self, adapter_id: int) -> None:
        with self._lock:
            self._adapters.pop(adapter_id, None)

    def __contains__(self, adapter_id: int) -> bool:
        with self._lock:
            return adapter_id in self._adapters


__all__ = ["AdapterCache", "LoRAError", "adapter_fingerprint", "read_adapter"]
