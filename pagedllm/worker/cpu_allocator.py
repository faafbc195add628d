"""Keep freed memory in the process on CPU.

Every step allocates large temporaries (gathered K/V, activations of a prefill chunk).
glibc serves allocations over its mmap threshold with fresh mmap()s and returns them on
free, so each step pays page faults to zero the same megabytes again, a large share of a batched
decode-attention layer's time (docs/benchmarks/kernels_and_dispatch.md, "Figures behind choices in
the code").
vLLM's CPU backend gets the same effect by preloading tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB. Returns False where glibc is absent."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
        )
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.debug("mallopt refused the allocator settings; CPU steps may page-fault more")
    return ok
