"""LoRASlots: which adapter each of the layers' `max_loras` slots holds, and a step's row groups.

The scheduler never runs more than max_loras adapters at once (a request of another waits), so
every adapter of a step finds a slot: the one it holds already, else a free one, else one whose
adapter this step does not run (least recently used first). Placing an adapter copies its pairs
into every LoRA layer (a memory copy of its size, once per change, not per step).
"""

from __future__ import annotations

import numpy as np

from pagedllm.lora.adapter import Adapter
from pagedllm.lora.layers import LoRALinear, LoRAMapping
from pagedllm.lora.targets import fused_parts


class LoRASlots:
    def __init__(self, layers: dict[str, LoRALinear], max_loras: int, mapping: LoRAMapping) -> None:
        self.layers = layers
        self.mapping = mapping
        self.held: list[int] = [0] * max_loras
        """Slot -> its adapter's id (0: empty)."""
        self._last_used = [0] * max_loras
        self._clock = 0

    def place(self, adapters: list[Adapter]) -> dict[int, int]:
        """Slots for this step's adapters (at most max_loras): adapter id -> slot."""
        self._clock += 1
        wanted = {adapter.adapter_id for adapter in adapters}
        assert len(wanted) <= len(self.held), "the scheduler runs at most max_loras adapters a step"
        slot_of = {}
        for adapter in adapters:
            if adapter.adapter_id in slot_of:
                continue
            if adapter.adapter_id in self.held:
                slot = self.held.index(adapter.adapter_id)
            else:
                free = [s for s, held in enumerate(self.held) if held not in wanted]
                slot = min(free, key=lambda s: (self.held[s] != 0, self._last_used[s]))
                self._write(slot, adapter)
            slot_of[adapter.adapter_id] = slot
            self._last_used[slot] = self._clock
        return slot_of

    def forget(self, adapter_id: int) -> None:
        """An adapter unloaded: its slot is free (a later adapter of the same id is read anew)."""
        if adapter_id in self.held:
            slot = self.held.index(adapter_id)
            self.held[slot] = 0
            for layer in self.layers.values():
                layer.clear_slot(slot)

    def set_groups(self, slots_of_rows: np.ndarray, counts: np.ndarray) -> None:
        """This step's groups from each request's slot (-1: the base model) and its token count,
        in the step's order (which the runner sorted by slot, so a slot's rows are one run)."""
        ends = np.cumsum(counts)
        groups: list[tuple[int, int, int]] = []
        for i, slot in enumerate(slots_of_rows.tolist()):
            if slot < 0:
                continue
            start = int(ends[i] - counts[i])
            if groups and groups[-1][0] == slot and groups[-1][2] == start:
                groups[-1] = (slot, groups[-1][1], int(ends[i]))
            else:
                groups.append((slot, start, int(ends[i])))
        self.mapping.set(groups)

    def _write(self, slot: int, adapter: Adapter) -> None:
        for path, layer in self.layers.items():
            block = path.rsplit(".", 1)[0]
            parts = [adapter.weights.get(f"{block}.{name}") for name in fused_parts(path)]
            layer.set_slot(slot, parts) if any(parts) else layer.clear_slot(slot)
        self.held[slot] = adapter.adapter_id
