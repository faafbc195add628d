"""EngineCore: the scheduler, the KV cache manager and the executor, one step at a time, in token
ids only (vLLM V1's `v1/engine/core.py`). It needs no tokenizer; the front ends (LLMEngine
offline, AsyncLLM for the server) tokenize, detokenize and find stop strings around it.

    EngineRequest --add_request--> Scheduler
    step(): Scheduler.schedule -> Executor.execute_model (every rank: runner -> model;
            rank 0: -> sampler) -> Scheduler.update_from_output -> list[EngineCoreOutput]

What crosses between a front end and the core (docs/architecture.md), all plain values:
    at start-up   EngineConfig and ModelSource in; ModelFacts out, once
    per request   EngineRequest in (checked, tokenized, its grammar compiled); the Request out,
                  whose metrics the front end's OutputProcessor reads
    per step      list[EngineCoreOutput] out; the ids a front end ends in (abort, a stop string
                  found in the text, a request whose output failed)
    on demand     SchedulerStats out; block tables and the block pool (the dashboard)

With --kv-offload-dir, each step first has every rank stage the disk tier's candidate blocks
(Executor.stage_kv_offload), and tells the scheduler's DiskIndex which ones all ranks hold.
Not thread-safe: one thread calls it (AsyncLLM's engine thread, or the offline caller's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pagedllm.config import EngineConfig
from pagedllm.core.disk_index import DiskIndex
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import EngineRequest, ModelFacts
from pagedllm.engine.model_source import ModelSource
from pagedllm.executor import Executor, WorkerDiedError, make_executor
from pagedllm.metrics.divergence import DivergenceFinder
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.request import Request, RequestStatus
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.structured_output.backend import RequestGrammar
from pagedllm.worker.kv_cache import KVCachePlan
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        *,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """Load the model on every rank, size and allocate the KV cache, log the start-up report.

        Args:
            decode: token ids to text, for the divergence finder's report alone (GET /stats);
                without it the report gives offsets and counts only.
        """
        start = time.monotonic()
        max_model_len = source.model_config.resolve_max_model_len(config.max_model_len)
        self.config = config.replace(max_model_len=max_model_len)
        self.executor: Executor = make_executor(self.config, source.folder, source.model_config)
        self.executor.start(max_model_len)
        try:
            self._set_up(source, max_model_len, decode, start)
        except BaseException:
            self.executor.shutdown()  # ranks 1.. must not wait for a step that never comes
            raise

    def _set_up(
        self,
        source: ModelSource,
        max_model_len: int,
        decode: Callable[[Sequence[int]], str] | None,
        start: float,
    ) -> None:
        """Everything after the ranks started: the facts, the report, the cache manager, the scheduler."""
        assert self.executor.driver_worker is not None and self.executor.kv_cache_plan is not None
        self.worker: Worker = self.executor.driver_worker
        """Rank 0's: the dtype, device and KV tensors (rank 0's share) the core reports and reads."""
        self.kv_cache_plan: KVCachePlan = self.executor.kv_cache_plan
        self.facts = ModelFacts(
            model_name=source.name,
            model_config=source.model_config,
            max_model_len=max_model_len,
            dtype=str(self.worker.dtype).removeprefix("torch."),
            device=self.worker.device.type,
            tp_size=self.executor.tp_size,
            kv_cache_plan=self.kv_cache_plan,
        )
        self._log_startup_report(time.monotonic() - start)
        self.disk_index = DiskIndex() if self.config.kv_offload_dir else None
        """The disk tier as the scheduler sees it (every rank opened its files at start-up)."""
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_plan.num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            self.config.prefix_caching_hash_algo,
            disk=self.disk_index,
        )
        self.divergence = (
            DivergenceFinder(self.config.block_size, decode, max_tokens=self.config.divergence_finder_tokens)
            if self.config.enable_prefix_caching and self.config.divergence_finder_tokens
            else None
        )
        """Where prompts stop sharing a prefix; thread-safe (its own lock): any thread reports."""
        self.scheduler = Scheduler(
            self.config, self.kv_cache_manager, max_model_len, divergence=self.divergence
        )

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, processed: EngineRequest) -> Request:
        """Queue a request a front end's InputProcessor made, trusted as it is: only bookkeeping
        runs here (the Request, its block hashes, its place in the scheduler). Returns the
        Request (the front end's OutputProcessor reads its metrics). Raises ValueError for an id
        already in use."""
        if processed.req_id in self.scheduler.requests:
            raise ValueError(f"request_id: {processed.req_id!r} is already in use")
        request = Request(
            req_id=processed.req_id,
            prompt_token_ids=list(processed.prompt_token_ids),  # the request's own copy
            sampling_params=processed.sampling_params,
            eos_token_ids=processed.eos_token_ids,
            max_tokens=processed.max_tokens,
            prompt=processed.prompt,
            cache_salt=processed.cache_salt,
            user=processed.user,
            lora_request=processed.lora_request,
            arrival_time=processed.arrival_time,
            grammar=RequestGrammar(processed.grammar) if processed.grammar is not None else None,
        )
        self.kv_cache_manager.hash_prompt(request)  # here, where a failure is this request's alone
        self.scheduler.add_request(request)
        return request

    def finish_requests(self, req_ids: Sequence[str], status: RequestStatus) -> None:
        """End requests now, wherever they are (an abort, a stop string a front end found, an
        output it could not make); their blocks go back to the pool at once. Unknown ids are
        ignored."""
        if req_ids:
            self.scheduler.finish_requests(list(req_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """One step of every running request: each one's new token ids (and logprobs, and its
        finish reason once finished). A request whose own sampling fails ends with finish_reason
        "error" and the others go on; anything else raised here leaves the core's state unknown,
        and the caller must stop using it."""
        if self.disk_index is not None:
            self._stage_disk_hits()
        scheduler_output = self.scheduler.schedule()
        grammar_bitmask = self.scheduler.grammar_bitmask(scheduler_output)
        started = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output, grammar_bitmask)
        if self.config.speculation is not None and scheduler_output.total_num_scheduled_tokens:
            self.scheduler.record_step_time(
                scheduler_output.total_num_scheduled_tokens, time.perf_counter() - started
            )
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def block_tables(self) -> list[tuple[str, str | None, list[int]]]:
        """Every request that holds KV blocks: its id, its caller and its block ids in block-table
        order. Between two steps only (the dashboard's block map)."""
        requests = self.scheduler.requests
        return [
            (req_id, requests[req_id].user if req_id in requests else None, block_ids)
            for req_id, block_ids in self.kv_cache_manager.block_tables().items()
        ]

    def reset_prefix_cache(self) -> int:
        """Drop every cached-but-free block. Returns how many were dropped."""
        return self.kv_cache_manager.reset_prefix_cache()

    def set_failure_callback(self, on_failure: Callable[[BaseException], None]) -> None:
        """`on_failure` is called, from another thread, if a tensor-parallel rank dies, even
        while no step runs (a step in flight raises by itself)."""
        self.executor.set_failure_callback(on_failure)

    # ---- the disk tier and shutdown ------------------------------------------------------------

    def close(self) -> None:
        """At a graceful shutdown: every cached block to the disk tier, so a restart starts warm;
        then the other tensor-parallel ranks stop."""
        try:
            self._save_kv_offload()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the other ranks and free the process group now, writing nothing (idempotent)."""
        self.executor.shutdown()

    def _stage_disk_hits(self) -> None:
        """Before schedule(): every rank's disk tier reads the blocks the lookups may hit (each
        candidate's hashes after those cached in memory), so schedule() itself touches no file;
        the scheduler may load what all ranks staged."""
        assert self.disk_index is not None
        candidates = self.scheduler.admission_candidates()
        chains = [c for r in candidates if (c := self.kv_cache_manager.uncached_hashes(r))]
        if not chains and not self.disk_index.has_staged:
            return  # nothing to read, nothing staged to let go: no call to the ranks
        self.disk_index.set_staged(self.executor.stage_kv_offload(chains))

    def _save_kv_offload(self) -> None:
        if self.disk_index is None:
            return
        cached = self.kv_cache_manager.cached_blocks()
        try:
            num_blocks, num_bytes = self.executor.close_kv_offload(cached)
        except WorkerDiedError as error:  # a rank is gone: its share cannot be written
            logger.warning("KV offload: cached blocks not written at shutdown (%s)", error)
            return
        logger.info(
            "KV offload: %d cached blocks written; %d blocks (%.2f GiB%s) in %s",
            len(cached),
            num_blocks,
            num_bytes / 2**30,
            f" over {self.executor.tp_size} ranks" if self.executor.tp_size > 1 else "",
            self.config.kv_offload_dir,
        )

    def _log_startup_report(self, load_seconds: float) -> None:
        """The lines vLLM users grep for: the weights (Worker.describe_weights), the KV cache
        (KVCachePlan.describe) and speculative decoding's settings."""
        lines = [
            self.worker.describe_weights(self.facts.model_name, load_seconds),
            *self.kv_cache_plan.describe(self.executor.tp_size, on_cuda=self.facts.device == "cuda"),
        ]
        if self.config.speculation is not None:
            lines.append(_describe_speculation(self.config.speculation))
        for line in lines:
            logger.info("%s", line)


def _describe_speculation(spec: SpeculativeConfig) -> str:
    proposer = (
        f"prompt lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
        if spec.method == "ngram"
        else f"suffix trees of depth {spec.suffix_decoding_max_tree_depth}"
    )
    return (
        f"Speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} draft tokens a "
        f"request and step ({proposer}), checked in the batch; fewer where the step's measured cost "
        "of a row beats a request's acceptance"
    )
