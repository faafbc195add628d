"""LoRARequest: which adapter a request runs under (vLLM's fields), by name, id and where it lives.

`lora_int_id` names the adapter inside the engine (its slot) and must be unique per adapter: two
requests naming the same id run the same adapter, whatever their paths. The prefix cache keys an
adapter's blocks by its weights' fingerprint (a hash of its files, set when the front end first
checks it): an adapter whose files changed, under its old name or id, or in a disk tier written
before a restart, never meets the blocks of its former weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm import limits


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF LoRA file."""
    base_model_name: str | None = None
    """The model the adapter was trained on, as `GET /v1/models` reports its `parent`."""
    fingerprint: str | None = None
    """A hash of the adapter's files (lora/checker.py sets it; callers leave it out)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: give the adapter a name")
        limits.check_text("lora_name", self.lora_name, limits.MAX_USER_CHARS)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id: must be an integer, got {self.lora_int_id!r}")
        if not 1 <= self.lora_int_id <= limits.INT32_MAX:
            raise ValueError(f"lora_int_id: must be 1 or more (0 is the base model), got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path: give the adapter's folder or GGUF file")

    @property
    def cache_key(self) -> str:
        """What keeps this adapter's prefix-cache blocks apart from the base model's and others':
        its weights' fingerprint, or (not checked yet) its id and name."""
        return self.fingerprint or f"{self.lora_int_id}:{self.lora_name}"
