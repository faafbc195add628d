"""Host memory on 2 MiB pages: what a kernel reads from all over on every step (the KV cache, the
LoRA adapters' slots) waits far less on address translation than on 4 KiB pages."""

from __future__ import annotations

import mmap

import torch


def fresh_pages(num_bytes: int) -> torch.Tensor:
    """Zeroed host memory that costs nothing until used: fresh anonymous pages, which the kernel
    zeroes as each is first touched. Writing zeros over gigabytes instead held up every start
    (and took the memory of blocks no request may ever reach). Asked for on 2 MiB pages where the
    kernel gives them (transparent huge pages, `madvise` or `always`): a request's blocks lie
    anywhere in the cache, and on 4 KiB pages attention's row reads wait on address translation
    (docs/benchmarks/vs_llama_cpp.md, "The KV cache on 2 MiB pages"). Memory is then taken 2 MiB
    at a time as it is written. A uint8 tensor of num_bytes (at least one byte is mapped)."""
    pages = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8)[:num_bytes]  # the tensor keeps the mapping alive
