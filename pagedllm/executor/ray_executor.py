"""--distributed-executor-backend ray: ranks 1.. as Ray actors, placed by a placement group
across the cluster's hosts (`ray start --head` on one, `ray start --address=HEAD:6379` on the
others, then the server on any of them; RAY_ADDRESS picks a cluster, otherwise this host's, and
without one a local Ray starts just for this engine).

Each actor runs rank_main.run_rank as one long call; its object ref resolves when the rank ends,
so the monitor waits on those refs: a dead actor makes ray.get raise RayActorError, and that
error's text is the reason the engine reports.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedllm.config import EngineConfig
from pagedllm.executor.distributed import DistributedExecutor
from pagedllm.executor.rank_main import RankSpec, run_rank
from pagedllm.model.config import ModelConfig
from pagedllm.worker.worker import resolve_device

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
STOP_WAIT_S = 10.0


class _RankActor:
    """One rank in a Ray worker process."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, spec: RankSpec, config: EngineConfig) -> None:
        run_rank(spec, config)


class RayDistributedExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, model_folder: Path, model_config: ModelConfig) -> None:
        super().__init__(config, model_folder, model_config)
        self._actors: list[ray.actor.ActorHandle] = []
        self._runs: list[ray.ObjectRef] = []
        self._placement: PlacementGroup | None = None
        self._started_ray = False

    def _driver_address(self) -> str:
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)  # RAY_ADDRESS, else this host's cluster, else a new one
            self._started_ray = True
        return ray.util.get_node_ip_address()

    def _launch(self, address: str, port: int) -> int:
        uses_gpu = resolve_device(self.config.device).type == "cuda"
        bundle = {"GPU": 1.0} if uses_gpu else {"CPU": 1.0}
        self._placement = placement = placement_group([bundle] * (self.tp_size - 1), strategy="PACK")
        try:
            ray.get(placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster has no room for {self.tp_size - 1} more ranks ({bundle} each) after "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; `ray status` shows its resources: add hosts or lower "
                "--tensor-parallel-size"
            ) from None
        actor_class = ray.remote(_RankActor)
        self._actors = [
            actor_class.options(
                num_cpus=0 if uses_gpu else 1,
                num_gpus=1 if uses_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, i),
            ).remote()
            for i in range(self.tp_size - 1)
        ]
        # local ranks: rank 0 first on the engine's host, then actors in rank order on each host
        actor_nodes: list[str] = ray.get([actor.node_id.remote() for actor in self._actors])
        nodes = [ray.get_runtime_context().get_node_id(), *actor_nodes]
        per_node = Counter(nodes)
        seen: Counter[str] = Counter()
        for rank, node in enumerate(nodes):
            local_rank = seen[node]
            seen[node] += 1
            if rank == 0:
                continue
            spec = RankSpec(rank, self.tp_size, address, port, local_rank, per_node[node], cuda_index=0)
            self._runs.append(self._actors[rank - 1].run.remote(spec, self.config))
        logger.info("Ray placed ranks 1..%d on %d host(s)", self.tp_size - 1, len(per_node))
        return per_node[nodes[0]]

    def _wait_for_death(self) -> str | None:
        ready, _ = ray.wait(self._runs, num_returns=1, timeout=None)
        if self._stopping:
            return None
        rank = self._runs.index(ready[0]) + 1
        try:
            ray.get(ready[0])
        except RayActorError as error:
            return f"the Ray actor of tensor-parallel rank {rank} died: {error}"
        except Exception as error:
            return f"tensor-parallel rank {rank} failed: {error}"
        return f"tensor-parallel rank {rank} stopped"

    def _stop_ranks(self) -> None:
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_WAIT_S)
        for actor in self._actors:
            ray.kill(actor)
        if self._placement is not None:
            remove_placement_group(self._placement)
        if self._started_ray:
            ray.shutdown()
