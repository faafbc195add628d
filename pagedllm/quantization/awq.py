"""AWQ checkpoints (AutoAWQ's GEMM layout: 4-bit codes, a scale and a zero per group)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.checkpoint_quant import CheckpointQuantization, Scheme, group_size, not_converted
from pagedllm.quantization.base import HeldByCheckpoint


class AWQ(HeldByCheckpoint):
    name = "awq"
    held_as = "awq checkpoint"

    @classmethod
    def read(cls, config: dict[str, Any]) -> CheckpointQuantization:
        bits = config.get("bits", config.get("w_bit", 4))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not config.get("zero_point", True):
            raise ValueError(
                f"quantization_config (awq): 4 bits in the GEMM layout with zero points is read, not "
                f"bits={bits}, version={version!r}, zero_point={config.get('zero_point')!r}"
            )
        group = group_size(config.get("group_size", config.get("q_group_size", 128)), "awq")
        scheme = Scheme("awq", 4, group, symmetric=False)
        return CheckpointQuantization("awq", ((("Linear",), scheme),), not_converted(config))
