"""LoRAChecker: a front end's check of the adapter a request names, before the engine thread.

An adapter is read and checked in full the first time its id is seen (adapter.py's checks), so a
bad one is the request's 400 (or the load route's), never a failure inside a step; then the id is
known and its requests pass at the cost of a dict lookup. The weights read here are dropped: the
worker reads and keeps its own copy (its cache, loading.py), as each tensor-parallel rank must.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from pagedllm.config import EngineConfig
from pagedllm.lora.loading import adapter_fingerprint, read_adapter
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig


class LoRAChecker:
    def __init__(self, config: ModelConfig, max_rank: int) -> None:
        self.config = config
        self.max_rank = max_rank
        self._known: dict[int, LoRARequest] = {}
        self._lock = threading.Lock()

    def check(self, request: LoRARequest) -> LoRARequest:
        """The request with its adapter's fingerprint (the prefix cache's key for it). Raises
        ValueError (LoRAError, FileNotFoundError's message) naming what is wrong."""
        with self._lock:
            known = self._known.get(request.lora_int_id)
        if known is not None and dataclasses.replace(known, fingerprint=request.fingerprint) == request:
            return known
        if known is not None:
            raise ValueError(
                f"lora_int_id: {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                "give each adapter its own id"
            )
        try:
            read_adapter(request, self.config, self.max_rank, torch.float32)
            checked = dataclasses.replace(request, fingerprint=adapter_fingerprint(request.lora_path))
        except FileNotFoundError as error:
            raise ValueError(str(error)) from error
        with self._lock:
            self._known[request.lora_int_id] = checked
        return checked

    def forget(self, adapter_id: int) -> None:
        with self._lock:
            self._known.pop(adapter_id, None)


def lora_checker_for(config: EngineConfig, model_config: ModelConfig) -> LoRAChecker | None:
    """A front end's checker with --enable-lora, else None."""
    return LoRAChecker(model_config, config.max_lora_rank) if config.enable_lora else None
