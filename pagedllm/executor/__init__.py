"""Executors: where the model's ranks run, behind one interface the engine steps through.

    UniProcExecutor          one rank, in this process: today's path, nothing added
    MultiprocExecutor        --distributed-executor-backend mp: ranks 1.. as processes on this host
    RayDistributedExecutor   --distributed-executor-backend ray: ranks 1.. as actors in a Ray cluster

(vLLM's names.) In the last two, rank 0 is the driver: it lives in the engine process, samples,
and returns each step's output; the other ranks receive each step's input and compute with it.
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor, WorkerDiedError
from pagedllm.model.config import ModelConfig

__all__ = ["Executor", "WorkerDiedError", "make_executor"]


def make_executor(config: EngineConfig, model_folder: Path, model_config: ModelConfig) -> Executor:
    """The executor the config asks for; nothing starts until `start()`."""
    if config.tensor_parallel_size == 1:
        from pagedllm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_folder, model_config)
    if config.distributed_executor_backend == "ray":
        try:
            from pagedllm.executor.ray_executor import RayDistributedExecutor
        except ImportError as error:
            raise ValueError(
                f"distributed_executor_backend: ray needs the ray package ({error}); "
                "pip install 'pagedllm[ray]', or use mp on one host"
            ) from None

        return RayDistributedExecutor(config, model_folder, model_config)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_folder, model_config)
