"""--distributed-executor-backend mp: ranks 1.. as processes on this host, watched through their
process sentinels.

Each rank is forked from the forkserver (pagedllm/forkserver.py), which imported what a rank runs
(this module, torch among its imports) once: a rank starts ~3 s sooner than a spawned one. A server
starts the forkserver as its own start-up begins (`RANK_PRELOAD`), so that those imports run beside
its own."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
from multiprocessing.process import BaseProcess
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.executor.distributed import DistributedExecutor
from pagedllm.executor.rank_main import RankSpec, run_rank
from pagedllm.forkserver import RANK_PRELOAD, forkserver_context, run_in_environment
from pagedllm.model.config import ModelConfig

STOP_WAIT_S = 10.0


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, model_folder: Path, model_config: ModelConfig) -> None:
        super().__init__(config, model_folder, model_config)
        self._processes: list[BaseProcess] = []

    def _driver_address(self) -> str:
        return "127.0.0.1"

    def _launch(self, address: str, port: int) -> int:
        context = forkserver_context(RANK_PRELOAD)
        environment = dict(os.environ)
        for rank in range(1, self.tp_size):
            spec = RankSpec(rank, self.tp_size, address, port, rank, self.tp_size, cuda_index=rank)
            process = context.Process(
                target=run_in_environment,
                args=(environment, run_rank, spec, self.config),
                name=f"pagedllm-rank-{rank}",
                daemon=True,
            )
            process.start()
            self._processes.append(process)
        return self.tp_size

    def _wait_for_death(self) -> str | None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return None
        rank = sentinels[ready[0]]  # type: ignore[index]
        process = self._processes[rank - 1]
        process.join()
        code = process.exitcode or 0
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return f"tensor-parallel rank {rank} (process {process.pid}) {how}"

    def _stop_ranks(self) -> None:
        for process in self._processes:
            process.join(STOP_WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
