"""--distributed-executor-backend mp: ranks 1.. as processes on this host, watched through their
process sentinels.

Each rank starts clean of this process's threads: forked from a server process that imported
what a rank runs (torch among it) once, at the first start, and nothing since (Python's
forkserver; spawned where the platform has none). A rank then starts ~3 s sooner than a spawned
one, which imports torch itself. The server was started with this process's environment of that
moment, so each rank is handed the environment as it is at its own start. (The forkserver is one
per process: a program that uses one too shares it, with this module among its imports.)"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.executor.distributed import DistributedExecutor
from pagedllm.executor.rank_main import RankSpec, run_rank
from pagedllm.model.config import ModelConfig

STOP_WAIT_S = 10.0


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, model_folder: Path, model_config: ModelConfig) -> None:
        super().__init__(config, model_folder, model_config)
        self._processes: list[BaseProcess] = []

    def _driver_address(self) -> str:
        return "127.0.0.1"

    def _launch(self, address: str, port: int) -> int:
        context = _rank_context()
        environment = dict(os.environ)
        for rank in range(1, self.tp_size):
            spec = RankSpec(rank, self.tp_size, address, port, rank, self.tp_size, cuda_index=rank)
            process = context.Process(
                target=_run_rank_in,
                args=(environment, spec, self.config),
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


def _rank_context() -> ForkServerContext | SpawnContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # what the server imports (a no-op once it runs)
    return context


def _run_rank_in(environment: dict[str, str], spec: RankSpec, config: EngineConfig) -> None:
    """run_rank with the environment the engine had when it launched the rank."""
    os.environ.clear()
    os.environ.update(environment)
    run_rank(spec, config)
