"""GPTQ checkpoints (AutoGPTQ's and GPTQModel's gptq and gptq_v2 formats, 4 or 8 bits)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.checkpoint_quant import CheckpointQuantization, Scheme, group_size, not_converted
from pagedllm.quantization.base import HeldByCheckpoint


class GPTQ(HeldByCheckpoint):
    name = "gptq"
    held_as = "gptq checkpoint"

    @classmethod
    def read(cls, config: dict[str, Any]) -> CheckpointQuantization:
        bits = config.get("bits", 4)
        checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8) or checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config (gptq): 4 or 8 bits in the gptq or gptq_v2 format is read, not "
                f"bits={bits}, checkpoint_format={checkpoint_format!r}"
            )
        scheme = Scheme(
            checkpoint_format,
            bits,
            group_size(config.get("group_size", 128), "gptq"),
            symmetric=bool(config.get("sym", False)),  # its zeros are stored either way
            act_order=bool(config.get("desc_act", False)),
        )
        return CheckpointQuantization("gptq", ((("Linear",), scheme),), not_converted(config))
