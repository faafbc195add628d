"""What ranks 1.. run, in a process (mp) or an actor (ray): join the group, load their share of
the model, then compute every step rank 0 broadcasts until it broadcasts None.

If rank 0 goes away, the broadcast this rank waits in fails (gloo sees the socket close) and the
error ends this process: no rank outlives the engine it served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.block_hash import BlockHash
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.distributed.parallel_state import destroy_tp_group, host_cores, init_tp_group, rank_threads
from pagedllm.logger import configure_logging
from pagedllm.model.config import ModelConfig
from pagedllm.model.config_reader import model_config_from_folder
from pagedllm.model.locate import resolve_model_folder
from pagedllm.worker.worker import Worker, resolve_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """How one rank joins: its rank, rank 0's rendezvous, and its place on its own host."""

    rank: int
    world_size: int
    address: str
    port: int
    local_rank: int
    """Among the ranks on its host (rank 0 is local rank 0 of the engine's host)."""
    local_world_size: int
    cuda_index: int
    """The CUDA device this rank uses on its host (Ray shows each actor its one GPU as 0)."""


@dataclass(frozen=True)
class StepInput:
    """A step as ranks 1.. need it: the scheduler's output and the tokens rank 0 sampled in the
    step before, which decodes read (the grammar bitmask stays with rank 0: only it samples)."""

    scheduler_output: SchedulerOutput
    sampled_token_ids: dict[str, list[int]]


@dataclass(frozen=True)
class StageKVOffload:
    """Before a schedule(): stage these chains in the disk tier, send back the staged hashes."""

    chains: list[list[BlockHash]]


@dataclass(frozen=True)
class CloseKVOffload:
    """A graceful shutdown: save these cached blocks, wait for the writes, send back the counts."""

    saves: list[tuple[int, BlockHash]]


def make_rank_worker(
    spec: RankSpec,
    config: EngineConfig,
    model_config: ModelConfig,
    folder: Path,
    check_ranks: Callable[[], None] = lambda: None,
) -> Worker:
    """Join the group and build this rank's Worker (rank 0 too: the executor calls this, with
    `check_ranks` to raise if a rank dies while it waits for them to join)."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.cuda_index)
    # float32 at most: an all-reduce of [token budget, hidden_size], or a decode step's logits
    # [max_num_seqs, vocab / ranks] (longer prompt-logprob chunks go through gloo)
    elements = max(
        config.token_budget * model_config.hidden_size,
        config.max_num_seqs * model_config.vocab_size // spec.world_size,
    )
    all_reduce_bytes = elements * 4
    tp = init_tp_group(
        spec.rank, spec.world_size, spec.address, spec.port, device, all_reduce_bytes, check_ranks
    )
    if device.type == "cpu" and config.num_threads is None:  # --num-threads is per rank
        threads = rank_threads(host_cores(config.cpu_cores), spec.local_rank, spec.local_world_size)
        config = config.replace(num_threads=threads)
    worker = Worker(config, folder, model_config, tp)
    assert config.max_model_len is not None  # the engine resolved it
    worker.load_model(max_position=config.max_model_len)
    worker.initialize_cache(worker.plan_kv_cache(config.max_model_len))
    if config.kv_offload_dir:
        worker.open_kv_offload()
    return worker


def run_rank(spec: RankSpec, config: EngineConfig) -> None:
    """A rank other than 0, from start to the engine's shutdown."""
    configure_logging(f"rank {spec.rank}")
    folder = resolve_model_folder(config.model, revision=config.revision, download_dir=config.download_dir)
    worker = make_rank_worker(spec, config, model_config_from_folder(folder), folder)
    assert worker.tp is not None
    num_steps = 0
    while (call := worker.tp.broadcast(None)) is not None:
        if isinstance(call, StageKVOffload):
            worker.tp.gather(worker.stage_kv_offload(call.chains))
            continue
        if isinstance(call, CloseKVOffload):
            worker.tp.gather(worker.close_kv_offload(call.saves))
            continue
        assert isinstance(call, StepInput)
        worker.append_sampled(call.sampled_token_ids)
        worker.execute_model(call.scheduler_output)
        num_steps += 1
    logger.info("Rank %d stops after %d steps", spec.rank, num_steps)
    destroy_tp_group()
