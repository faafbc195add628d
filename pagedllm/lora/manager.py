"""LoRAManager: a worker's adapters: read (loading.AdapterCache), placed in the layers' slots
(slots.LoRASlots), and each step's rows ordered so that every adapter's rows are one run."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.lora.layers import LoRAMapping, add_lora_layers
from pagedllm.lora.loading import AdapterCache
from pagedllm.lora.slots import LoRASlots
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype
    ) -> None:
        assert config.max_cpu_loras is not None
        mapping = LoRAMapping()
        layers = add_lora_layers(model, config.max_loras, config.max_lora_rank, dtype, mapping)
        self.cache = AdapterCache(model_config, config.max_lora_rank, dtype, config.max_cpu_loras)
        self.slots = LoRASlots(layers, config.max_loras, mapping)
        self.nbytes = sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in layers.values())
        """The slots' memory, beside the weights."""

    def arrange(
        self, adapters: list[LoRARequest | None], counts: list[int]
    ) -> tuple[list[int], dict[int, str]]:
        """This step's requests (`adapters[i]`: request i's, None for the base model; `counts[i]`
        its tokens): places their adapters, and returns the step order (request indices grouped
        by adapter, for which it sets the layers' row groups) and the requests whose adapter
        could not be read (index -> error): they run as the base model and fail."""
        read, errors = {}, {}
        for request in adapters:
            if request is None or request.lora_int_id in read or request.lora_int_id in errors:
                continue
            try:
                read[request.lora_int_id] = self.cache.get(request)
            except (OSError, ValueError) as error:  # the file changed or went since its check
                logger.error("Adapter %s cannot be read: %s", request.lora_name, error)
                errors[request.lora_int_id] = f"{type(error).__name__}: {error}"
        slot_of = self.slots.place(list(read.values()))
        slots = [slot_of.get(request.lora_int_id, -1) if request is not None else -1 for request in adapters]
        order = sorted(range(len(adapters)), key=lambda i: slots[i])
        self.slots.set_groups(np.array([slots[i] for i in order]), np.array([counts[i] for i in order]))
        failed = {
            i: errors[request.lora_int_id]
            for i, request in enumerate(adapters)
            if request is not None and request.lora_int_id in errors
        }
        return order, failed
