"""What the engine asks of an executor, whichever runs the ranks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.core.block_hash import BlockHash
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.model.config import ModelConfig
from pagedllm.structured_output.bitmask import GrammarBitmask
from pagedllm.worker.kv_cache import KVCachePlan
from pagedllm.worker.worker import Worker

FailureCallback = Callable[[BaseException], None]


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank's process or actor is gone: the model cannot run a step any more."""


class Executor(ABC):
    """Rank 0's Worker lives in this process (`driver_worker`: its dtype, device, weights and KV
    tensors are what the engine reports); the others, if any, elsewhere. Each rank's disk tier
    (--kv-offload-dir) is its own: the engine reaches them all through the kv_offload calls."""

    def __init__(self, config: EngineConfig, model_folder: Path, model_config: ModelConfig) -> None:
        self.config = config
        self.model_folder = model_folder
        self.model_config = model_config
        self.tp_size = config.tensor_parallel_size
        self.driver_worker: Worker | None = None
        self.kv_cache_plan: KVCachePlan | None = None
        """One rank's cache (every rank holds the same number of blocks)."""

    @abstractmethod
    def start(self, max_model_len: int) -> None:
        """Load the model on every rank, agree on the KV blocks, allocate them."""

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One step on every rank; rank 0's sampled tokens (the bitmask is rank 0's alone)."""

    @abstractmethod
    def stage_kv_offload(self, chains: list[list[BlockHash]]) -> set[BlockHash]:
        """Before schedule(), with --kv-offload-dir: every rank's disk tier reads the blocks the
        next lookups may take (`chains`: per candidate, its hashes after those cached in
        memory); returns the hashes every rank staged, which the scheduler may load."""

    @abstractmethod
    def close_kv_offload(self, saves: list[tuple[int, BlockHash]]) -> tuple[int, int]:
        """At a graceful shutdown, with --kv-offload-dir: every rank saves these cached blocks
        (block_id, hash) and waits (bounded) for its writes; the blocks and bytes then on disk,
        summed over the ranks."""

    @abstractmethod
    def set_failure_callback(self, on_failure: FailureCallback) -> None:
        """`on_failure` is called (from a monitor thread) with a WorkerDiedError when a rank dies,
        even while no step runs."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the other ranks (a graceful end)."""
