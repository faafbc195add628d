"""Keep freed memory in the process on CPU once the model is loaded; return it while loading.

Every step allocates large temporaries (gathered K/V, activations of a prefill chunk).
glibc serves allocations over its mmap threshold with fresh mmap()s and returns them on
free, so each step pays page faults to zero the same megabytes again, a large share of a batched
decode-attention layer's time (docs/benchmarks/kernels_and_dispatch.md, "Figures behind choices in
the code").
vLLM's CPU backend gets the same effect by preloading tcmalloc.

Loading is the other way round: a GGUF's tensors are read and packed one by one, each through
temporaries of a few MB between long-lived packed weights. glibc's default raises its mmap
threshold to the largest chunk freed so far, so those temporaries come from the heap, and the holes
they leave between packed weights stay resident: 2.4 GiB over 7.95 GiB of packed weights for an
8.5 GB mixture-of-experts file, 5 GiB for a 17 GB one (docs/benchmarks/moe.md). A fixed threshold
while loading maps each such temporary apart and unmaps it when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30
_RETURN_BYTES = 1 << 16  # glibc's own mmap threshold before it adapts is 128 KiB


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB. Returns False where glibc is absent."""
    return _set_thresholds(_KEEP_BYTES)


def return_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at 64 KiB (for loading). False where glibc is absent."""
    return _set_thresholds(_RETURN_BYTES)


def _set_thresholds(size: int) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, size) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, size) == 1
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.debug("mallopt refused the allocator settings; CPU steps may page-fault more")
    return ok
