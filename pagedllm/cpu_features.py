"""What this CPU can do, read once from /proc/cpuinfo (empty where there is none)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU (x86 `flags`, Arm `Features`)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    line = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def has_fast_bf16() -> bool:
    """bfloat16 arithmetic in hardware (AVX-512-BF16 or AMX): there bfloat16 is the fast dtype,
    and oneDNN has kernels for it; elsewhere bfloat16 is converted in software."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
