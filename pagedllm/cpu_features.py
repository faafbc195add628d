"""What this CPU can do, read once from /proc/cpuinfo (empty where there is none)."""

from __future__ import annotations

import functools
import os
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


@functools.cache
def cpu_model_name() -> str:
    """The first CPU's model name ("unknown CPU" where /proc/cpuinfo does not say)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next(
        (line.partition(":")[2].strip() for line in lines if line.startswith("model name")), "unknown CPU"
    )


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest cache of the first CPU (its L3, usually); 32 MiB where sysfs does not say."""
    sizes = []
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip().upper()
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 * 1024**2)


@functools.cache
def describe_host() -> str:
    """The CPU model, core count and the flags that decide our kernels: for every published figure."""
    model = cpu_model_name()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    flags = ", ".join(flag for flag in wanted if flag in cpu_flags()) or "none of avx2/avx512/amx"
    return f"{model}, {os.cpu_count()} cores, {flags}"
