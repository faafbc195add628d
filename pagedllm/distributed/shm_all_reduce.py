"""All-reduce through shared memory, for tensor-parallel ranks on one x86 host (CPU).

Why: a gloo all-reduce hands the tensor to gloo's threads and sleeps until the peer's bytes
arrive over TCP; a forward pass has two all-reduces per layer, and on a small CPU host they took
most of a decode step (docs/benchmarks/kernels_and_dispatch.md, "Figures behind choices in the
code"). Here each rank
copies its partial sums into its slot of a shared buffer, publishes a sequence number, and spins
(yielding the core) until every rank has published; then every rank adds the slots in rank order,
so all ranks hold bit-identical sums. vLLM's CPU backend does the same in C++.

    /dev/shm file (unlinked once every rank has mapped it):
    | flag rank 0 | flag rank 1 | ... (one 64-byte line each) | data, parity 0: world x max_bytes | parity 1 |

Two data buffers, used by turns: a rank writes buffer p again only after every peer published
the step between, which each does after reading buffer p, so no slot is overwritten while read.
Ordering: on x86 a core's stores become visible in program order (data before flag) and loads
are not reordered with loads (flag before data), which is all this needs; elsewhere gloo is used.
"""

from __future__ import annotations

import os
import platform
import time

import torch

_LINE = 64  # bytes: one flag per cache line, so ranks spinning on flags do not share lines
CHECK_EVERY = 1024
"""Spins between checks that every peer process is alive and the timeout has not passed."""


def is_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class ShmAllReduce:
    """Sum over the ranks of one host, in place. Every rank calls with the same shapes in the
    same order (the forward pass guarantees it); tensors over max_bytes go elsewhere."""

    def __init__(self, path: str, rank: int, world_size: int, max_bytes: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        size = self.file_bytes(world_size, max_bytes)
        self._memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        flags = self._memory[: world_size * _LINE].view(torch.int64)
        self._flags = flags.numpy()[:: _LINE // 8]  # [world_size], read straight from the mapping
        self._data = self._memory[world_size * _LINE :].view(2, world_size, max_bytes)
        self._peer_pids: list[int] = []
        self._seq = 0

    @staticmethod
    def file_bytes(world_size: int, max_bytes: int) -> int:
        return world_size * _LINE + 2 * world_size * max_bytes

    def set_peer_pids(self, pids: list[int]) -> None:
        """The other ranks' processes: a spin stops (RuntimeError) once one of them is gone."""
        self._peer_pids = [pid for rank, pid in enumerate(pids) if rank != self.rank]

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        slots = self._publish(x)
        out = x.view(-1)
        out.copy_(slots[0])
        for rank in range(1, self.world_size):
            out.add_(slots[rank])
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's x (views of the shared buffer: use them before the next call);
        others: None. Every rank still waits for all, which keeps the buffers' turns safe."""
        slots = self._publish(x)
        if self.rank != 0:
            return None
        return [slots[rank].view(x.shape) for rank in range(self.world_size)]

    def _publish(self, x: torch.Tensor) -> torch.Tensor:
        """Copy x into this rank's slot, publish, wait for every rank; the slots [world, numel]."""
        self._seq += 1
        slots = self._data[self._seq & 1, :, : x.numel() * x.element_size()].view(x.dtype)
        slots[self.rank].copy_(x.view(-1))
        self._flags[self.rank] = self._seq  # after the data: x86 keeps the order
        self._wait_for_all()
        return slots

    def _wait_for_all(self) -> None:
        spins = 0
        deadline = None
        while self._flags.min() < self._seq:
            os.sched_yield()  # free at once on an idle core; lets others run on a busy one
            spins += 1
            if spins % CHECK_EVERY == 0:
                deadline = deadline or time.monotonic() + self.timeout_s
                self._check(deadline)

    def _check(self, deadline: float) -> None:
        for pid in self._peer_pids:
            if not _is_running(pid):
                raise RuntimeError(f"a tensor-parallel peer (process {pid}) is gone")
        if time.monotonic() > deadline:
            raise RuntimeError(f"a tensor-parallel all-reduce waited over {self.timeout_s:.0f} s for a peer")


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (a dead process its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
