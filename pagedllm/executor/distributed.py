"""Rank 0's side of tensor parallelism, whichever backend runs ranks 1..

Each step rank 0 broadcasts the step's input (a few KB pickled: ids, counts, new requests once)
over the control group, then runs the same forward as every rank, then samples alone. A rank
that dies is noticed twice over: the collective rank 0 is in fails at once (gloo sees the socket
close), and a monitor thread, watching the processes or actors, reports it even while the engine
is idle, so the server turns unhealthy and exits instead of waiting for a step that never ends.
"""

from __future__ import annotations

import atexit
import logging
import threading
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import cast

from pagedllm.config import EngineConfig
from pagedllm.core.block_hash import BlockHash
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import (
    check_no_tp_group,
    destroy_tp_group,
    free_port,
)
from pagedllm.executor.abstract import Executor, FailureCallback, WorkerDiedError
from pagedllm.executor.rank_main import (
    CloseKVOffload,
    RankSpec,
    StageKVOffload,
    StepInput,
    make_rank_worker,
)
from pagedllm.model.config import ModelConfig
from pagedllm.structured_output.bitmask import GrammarBitmask
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

DEATH_NOTICE_S = 5.0
"""After a collective fails, how long to wait for the monitor to say which rank died and why."""


class DistributedExecutor(Executor):
    """Rank 0 in this process; the subclass launches ranks 1.. and says when one dies."""

    def __init__(self, config: EngineConfig, model_folder: Path, model_config: ModelConfig) -> None:
        super().__init__(config, model_folder, model_config)
        self._failure: WorkerDiedError | None = None
        self._died = threading.Event()
        self._on_failure: FailureCallback | None = None
        self._last_sampled: dict[str, list[int]] = {}
        self._stopping = False

    # ---- what a backend provides -------------------------------------------------------------

    @abstractmethod
    def _driver_address(self) -> str:
        """The address ranks 1.. reach rank 0 at."""

    @abstractmethod
    def _launch(self, address: str, port: int) -> int:
        """Start ranks 1.. (each runs rank_main.run_rank); returns how many ranks share rank 0's host."""

    @abstractmethod
    def _wait_for_death(self) -> str | None:
        """Block until a rank ends; why it did, or None once shutdown() has begun."""

    @abstractmethod
    def _stop_ranks(self) -> None:
        """After the stop broadcast: wait briefly for ranks 1.. to end, then end them."""

    # ---- the executor ------------------------------------------------------------------------

    def start(self, max_model_len: int) -> None:
        self.model_config.check_tensor_parallel_size(self.tp_size)
        check_no_tp_group()  # before any rank starts: a failed start would free the group it found
        self.config = config = self.config.replace(max_model_len=max_model_len)
        address = self._driver_address()
        port = free_port(address)
        try:
            local_world_size = self._launch(address, port)
        except Exception:  # e.g. a Ray cluster without room: nothing left behind
            self._stopping = True
            self._stop_ranks()
            raise
        atexit.register(self._at_exit)
        threading.Thread(target=self._monitor, name="pagedllm-rank-monitor", daemon=True).start()
        spec = RankSpec(0, self.tp_size, address, port, 0, local_world_size, cuda_index=0)
        try:
            worker = make_rank_worker(spec, config, self.model_config, self.model_folder, self._raise_if_dead)
        except Exception as error:
            failure = self._failure_after(error)
            self.shutdown()
            raise failure from error
        self.driver_worker = worker
        self.kv_cache_plan = worker.kv_cache_plan
        assert worker.tp is not None
        collective = "NCCL" if worker.device.type == "cuda" else "gloo"
        logger.info(
            "Tensor parallelism: %d ranks (%s backend), rank 0 in this process, %d on this host, "
            "all-reduce through %s",
            self.tp_size,
            self.config.distributed_executor_backend,
            local_world_size,
            "shared memory" if worker.tp.shm is not None else collective,
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        assert self.driver_worker is not None and self.driver_worker.tp is not None, "start() first"
        if self._failure is not None:
            raise self._failure
        try:
            self.driver_worker.tp.broadcast(StepInput(scheduler_output, self._last_sampled))
            output = self.driver_worker.execute_model(scheduler_output, grammar_bitmask)
        except Exception as error:
            raise self._failure_after(error) from error
        self._last_sampled = output.sampled_token_ids
        return output

    def stage_kv_offload(self, chains: list[list[BlockHash]]) -> set[BlockHash]:
        worker = self._started_driver()
        staged = self._call_every_rank(StageKVOffload(chains), lambda: worker.stage_kv_offload(chains))
        return set.intersection(*(set(cast(list[BlockHash], hashes)) for hashes in staged))

    def close_kv_offload(self, saves: list[tuple[int, BlockHash]]) -> tuple[int, int]:
        worker = self._started_driver()
        counts = [
            cast(tuple[int, int], c)
            for c in self._call_every_rank(CloseKVOffload(saves), lambda: worker.close_kv_offload(saves))
        ]
        return sum(blocks for blocks, _ in counts), sum(nbytes for _, nbytes in counts)

    def _started_driver(self) -> Worker:
        assert self.driver_worker is not None and self.driver_worker.tp is not None, "start() first"
        return self.driver_worker

    def _call_every_rank(
        self, call: StageKVOffload | CloseKVOffload, on_driver: Callable[[], object]
    ) -> list[object]:
        """Broadcast `call` to ranks 1.., run `on_driver` here; every rank's answer, in rank order."""
        tp = self._started_driver().tp
        assert tp is not None
        if self._failure is not None:
            raise self._failure
        try:
            tp.broadcast(call)
            answers = tp.gather(on_driver())
        except Exception as error:
            raise self._failure_after(error) from error
        assert answers is not None
        return answers

    def set_failure_callback(self, on_failure: FailureCallback) -> None:
        self._on_failure = on_failure
        if self._failure is not None:
            on_failure(self._failure)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        worker = self.driver_worker
        if self._failure is None and worker is not None and worker.tp is not None:
            try:
                worker.tp.broadcast(None)
            except Exception:
                logger.warning("Could not tell ranks 1.. to stop; ending them", exc_info=True)
        self._stop_ranks()
        destroy_tp_group()
        atexit.unregister(self._at_exit)  # which holds this executor (and its model) otherwise

    def _at_exit(self) -> None:
        """The interpreter ends without shutdown() (an offline script): ranks 1.. end with it
        (multiprocessing ends daemon processes, Ray its actors), which is no failure to report."""
        self._stopping = True

    def _raise_if_dead(self) -> None:
        """Raise the monitor's failure, where it has seen a rank die."""
        if self._failure is not None:
            raise self._failure

    def _failure_after(self, error: Exception) -> Exception:
        """What to raise for an error in a step or at start. A failed collective (RuntimeError)
        most likely means a rank died: its death, with the reason, if the monitor sees it within
        DEATH_NOTICE_S. Anything else (a ValueError every rank raises alike) as it is."""
        if isinstance(error, RuntimeError):
            self._died.wait(DEATH_NOTICE_S)
        return self._failure or error

    def _monitor(self) -> None:
        reason = self._wait_for_death()
        if reason is None or self._stopping:
            return
        logger.error("%s; the engine cannot run another step", reason)
        self._failure = WorkerDiedError(reason)
        self._died.set()
        if self._on_failure is not None:
            self._on_failure(self._failure)
