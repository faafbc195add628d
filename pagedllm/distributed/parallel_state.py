"""The groups a tensor-parallel rank talks through, and each rank's share of its host's cores.

Two groups over the same ranks, as vLLM keeps them:

    control group   gloo, no practical timeout: rank 0 broadcasts each step's input; the other
                    ranks wait in it while the server is idle (for hours, maybe)
    tp group        the model's all-reduces: gloo on CPU, NCCL on CUDA, with a timeout, so a
                    rank whose peer hangs (not dies: a dead peer's socket closes at once) stops

Everything is passed as a value (`TPGroup`) to the model and the worker; there is no global
group, and with one rank there is none at all (no collective on the TP=1 path).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.config import parse_cores
from pagedllm.distributed import shm_all_reduce
from pagedllm.distributed.shm_all_reduce import ShmAllReduce

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = datetime.timedelta(seconds=300)
"""How long rank 0 waits for every rank to join (a rank that never starts fails the start-up)."""
JOINED_KEY = "pagedllm/joined"
"""Rank 0's store counts here the ranks that reached it."""
JOIN_POLL_S = 0.05
"""How often rank 0 counts the ranks joined and asks whether one has died."""
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
"""Generous: a rank may be building the C++ kernel (~25 s) while its peers wait."""


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    """The collectives of the forward pass."""
    control: dist.ProcessGroup
    """Step inputs and start-up agreement (gloo, CPU tensors)."""
    shm: ShmAllReduce | None = None
    """All ranks on one x86 host, on CPU: all-reduces through shared memory, not gloo."""

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns the step's output; the others only compute."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x side by side, [rows, world_size x columns]; others: None.
        (A vocabulary-parallel LM head's logits, in vocabulary order.)"""
        if self.shm is not None and self.shm.fits(x):
            parts = self.shm.gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
            dist.gather(x, parts, dst=0, group=self.group)
        return None if parts is None else torch.cat(parts, dim=1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (the KV cache blocks they all can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def broadcast(self, obj: object) -> object:
        """Rank 0's obj on every rank (pickled; a step's input is a few KB)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: object) -> list[object] | None:
        """Rank 0: every rank's obj, in rank order; others: None (pickled, over the control group)."""
        objects: list[object] | None = [None] * self.world_size if self.is_driver else None
        dist.gather_object(obj, objects, dst=0, group=self.control)
        return objects


def init_tp_group(
    rank: int,
    world_size: int,
    address: str,
    port: int,
    device: torch.device,
    all_reduce_bytes: int,
    check_ranks: Callable[[], None] = lambda: None,
) -> TPGroup:
    """Join the group at address:port (rank 0 listens there); returns once all ranks have.
    `all_reduce_bytes`: the largest all-reduce the shared-memory path must take. `check_ranks`
    (rank 0's): called while it waits for the others, to raise where one has died before it
    joined (a script without `if __name__ == "__main__":`, run again by its rank's process, ends
    that process at once), instead of waiting out STARTUP_TIMEOUT."""
    store = dist.TCPStore(
        address, port, world_size, is_master=rank == 0, timeout=STARTUP_TIMEOUT, wait_for_workers=False
    )
    if rank == 0:
        _wait_for_ranks(store, world_size, check_ranks)
    else:
        store.add(JOINED_KEY, 1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=STARTUP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    shm = _open_shm(rank, world_size, port, all_reduce_bytes, control) if device.type == "cpu" else None
    return TPGroup(rank, world_size, group, control, shm)


def _wait_for_ranks(store: dist.TCPStore, world_size: int, check_ranks: Callable[[], None]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while (joined := store.add(JOINED_KEY, 0)) < world_size - 1:
        check_ranks()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{joined} of ranks 1..{world_size - 1} joined within {STARTUP_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(JOIN_POLL_S)


def _open_shm(rank: int, world_size: int, port: int, max_bytes: int, control) -> ShmAllReduce | None:
    """Rank 0 makes the shared file; if every rank sees it (one host), all map it and rank 0
    unlinks it at once (the mappings keep it; nothing is left behind, even after a crash)."""
    path = None
    if rank == 0 and shm_all_reduce.is_supported():
        size = ShmAllReduce.file_bytes(world_size, max_bytes)
        path = _reserve(f"/dev/shm/pagedllm-tp-{os.getpid()}-{port}", size)
    box = [path]
    dist.broadcast_object_list(box, src=0, group=control)
    path = box[0]
    seen: list[tuple[bool, int]] = [(False, 0)] * world_size
    mine = (path is not None and os.path.exists(path), os.getpid())
    dist.all_gather_object(seen, mine, group=control)
    shm = None
    if path is not None and all(sees for sees, _ in seen):
        shm = ShmAllReduce(path, rank, world_size, max_bytes, COLLECTIVE_TIMEOUT.total_seconds())
        shm.set_peer_pids([pid for _, pid in seen])
    dist.barrier(group=control)
    if rank == 0 and path is not None:
        os.unlink(path)
    return shm


def _reserve(path: str, size: int) -> str | None:
    """Make the file with all its pages taken now: a sparse file on a /dev/shm smaller than it
    (Docker's default is 64 MiB) would end the first step that touches a page past the limit
    with SIGBUS. None where it does not fit: the ranks then all-reduce through gloo."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        logger.warning(
            "No room for %d MiB in /dev/shm (%s): ranks all-reduce through gloo", size >> 20, error
        )
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def check_no_tp_group() -> None:
    """Raise unless this process is free to start a group: torch.distributed holds one default
    group per process, so a second engine cannot start while the first holds it."""
    if dist.is_initialized():
        raise RuntimeError(
            "another tensor-parallel engine in this process still holds its torch.distributed group; "
            "call that LLM's shutdown() (or create it with `with LLM(...) as llm:`) before starting "
            "another"
        )


def destroy_tp_group() -> None:
    """Free every group of this process (the default one and those made from it)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(address: str) -> int:
    """A TCP port nobody listens on now, for rank 0's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def rank_threads(num_cores: int, local_rank: int, local_world_size: int) -> int:
    """This rank's share of its host's cores, as a thread count (as even as the count allows).

    Ranks are not pinned to their cores: a pinned rank's gloo threads wait for the one core its
    rank keeps busy, which made an all-reduce much slower
    (docs/benchmarks/kernels_and_dispatch.md, "Figures behind choices in the code").
    """
    per_rank, extra = divmod(num_cores, local_world_size)
    return max(1, per_rank + (local_rank < extra))


def host_cores(cpu_cores: str | None) -> int:
    """How many cores ranks on this host split: --cpu-cores, else those this process may use."""
    return len(parse_cores(cpu_cores) if cpu_cores else os.sched_getaffinity(0))
