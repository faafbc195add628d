"""The groups a tensor-parallel rank talks through, and the rules of the split.

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
import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.config import parse_cores
from pagedllm.model.config import ModelConfig

STARTUP_TIMEOUT = datetime.timedelta(seconds=300)
"""How long rank 0 waits for every rank to join (a rank that never starts fails the start-up)."""
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

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns the step's output; the others only compute."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

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


def init_tp_group(rank: int, world_size: int, address: str, port: int, device: torch.device) -> TPGroup:
    """Join the group at address:port (rank 0 listens there); returns once all ranks have."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=STARTUP_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, world_size, group, control)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(address: str) -> int:
    """A TCP port nobody listens on now, for rank 0's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def check_divides(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError, naming the sizes that work, unless every rank gets whole heads."""
    counts = {
        "attention heads": config.num_attention_heads,
        "KV heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, count in counts.items():
        if count % tp_size:
            common = math.gcd(*counts.values())
            sizes = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
            raise ValueError(
                f"tensor_parallel_size: {tp_size} does not divide this model's {count} {name}, and "
                f"each rank must own an equal share; sizes that work for this model: {sizes}"
            )


def rank_cores(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """This rank's share of a host's cores: contiguous, as even as the count allows."""
    if len(cores) < local_world_size:
        return cores  # fewer cores than ranks: they share (slow, but it runs)
    per_rank, extra = divmod(len(cores), local_world_size)
    start = local_rank * per_rank + min(local_rank, extra)
    return cores[start : start + per_rank + (local_rank < extra)]


def host_cores(cpu_cores: str | None) -> list[int]:
    """The cores ranks on this host split: --cpu-cores, else those this process may use."""
    return sorted(parse_cores(cpu_cores) if cpu_cores else os.sched_getaffinity(0))
