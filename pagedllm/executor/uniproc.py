"""One rank in the engine process: the step goes straight to the worker, nothing in between."""

from __future__ import annotations

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, FailureCallback
from pagedllm.structured_output.bitmask import GrammarBitmask
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def start(self, max_model_len: int) -> None:
        worker = Worker(self.config, self.model_folder, self.model_config)
        worker.load_model(max_position=max_model_len)
        self.kv_cache_plan = worker.plan_kv_cache(max_model_len)
        worker.initialize_cache(self.kv_cache_plan)
        if self.config.kv_offload_dir:
            worker.open_kv_offload()
        self.driver_worker = worker

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        assert self.driver_worker is not None, "start() first"
        return self.driver_worker.execute_model(scheduler_output, grammar_bitmask)

    def stage_kv_offload(self, chains: list[list[BlockHash]]) -> set[BlockHash]:
        assert self.driver_worker is not None, "start() first"
        return set(self.driver_worker.stage_kv_offload(chains))

    def close_kv_offload(self, saves: list[tuple[int, BlockHash]]) -> tuple[int, int]:
        assert self.driver_worker is not None, "start() first"
        return self.driver_worker.close_kv_offload(saves)

    def set_failure_callback(self, on_failure: FailureCallback) -> None:
        """Nothing to watch: the one rank cannot die apart from this process."""

    def shutdown(self) -> None:
        """Nothing to stop."""
