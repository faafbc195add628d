"""LLMEngine: requests in, one step at a time, RequestOutputs out.

    add_request -> Scheduler.schedule -> Executor.execute_model (every rank: runner -> model;
                   rank 0: -> sampler)
                -> Scheduler.update_from_output -> OutputProcessor (text, stop strings)

With --kv-offload-dir, each step first has every rank stage the disk tier's candidate blocks
(Executor.stage_kv_offload), and tells the scheduler's DiskIndex which ones all ranks hold.

The offline LLM class and the server's engine loop both drive this object; it is not
thread-safe: one thread calls it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.core.disk_index import DiskIndex
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.input_processor import EngineRequest, InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.executor import Executor, WorkerDiedError, make_executor
from pagedllm.metrics.divergence import DivergenceFinder
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.metrics.stats_logger import StatsLogger
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import loading, loading_tokenizer
from pagedllm.model.gguf_convert import gguf_source
from pagedllm.model.loader import model_display_name, resolve_model_folder, resolve_tokenizer_folder
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backend import RequestGrammar
from pagedllm.tokenizer import load_tokenizer, workload_prompts
from pagedllm.worker.kv_cache import KVCachePlan
from pagedllm.worker.worker import Worker
from pagedllm.workload import load_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        self.model_name = model_display_name(config.model)
        with loading(config.model or self.model_name):  # a damaged file: ModelLoadError, one line
            folder = resolve_model_folder(
                config.model, revision=config.revision, download_dir=config.download_dir
            )
            self.model_config = ModelConfig.from_folder(folder)
        self.tokenizer_folder = (
            resolve_tokenizer_folder(
                config.tokenizer, revision=config.tokenizer_revision, download_dir=config.download_dir
            )
            if config.tokenizer
            else folder
        )
        max_model_len = self.model_config.resolve_max_model_len(config.max_model_len)
        self.config = config.replace(max_model_len=max_model_len)
        with loading_tokenizer(self.tokenizer_folder):
            self.tokenizer = self.load_tokenizer()

        self.executor: Executor = make_executor(self.config, folder, self.model_config)
        self.executor.start(max_model_len)
        try:
            self._set_up(max_model_len, start)
        except BaseException:
            self.executor.shutdown()  # ranks 1.. must not wait for a step that never comes
            raise

    def _set_up(self, max_model_len: int, start: float) -> None:
        """Everything after the ranks started: the cache manager, scheduler, outputs, warm-up."""
        assert self.executor.driver_worker is not None and self.executor.kv_cache_plan is not None
        self.worker: Worker = self.executor.driver_worker
        """Rank 0's: the dtype, device and KV tensors (rank 0's share) the engine reports and reads."""
        self.kv_cache_plan: KVCachePlan = self.executor.kv_cache_plan
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
            DivergenceFinder(
                self.config.block_size,
                self.tokenizer.decode,  # type: ignore[arg-type]  # a flat id list decodes to one str
                max_tokens=self.config.divergence_finder_tokens,
            )
            if self.config.enable_prefix_caching and self.config.divergence_finder_tokens
            else None
        )
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, max_model_len, self.divergence)
        self.output_processor = OutputProcessor(
            self.tokenizer, speculative=self.config.speculation is not None
        )
        self.stats_logger = (
            None
            if self.config.disable_log_stats
            else StatsLogger(self.config.log_stats_interval, self.config.enable_prefix_caching)
        )
        self._eos_token_ids = frozenset(
            [
                *self.model_config.eos_token_ids,
                *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []),
            ]
        )
        self._request_counter = itertools.count()
        self.input_processor = InputProcessor(
            max_model_len=max_model_len,
            vocab_size=self.model_config.vocab_size,
            max_logprobs=self.config.max_logprobs,
            tokenizer=self.tokenizer,
            eos_token_ids=self._eos_token_ids,
        )
        """The front door: any thread may call it (it reads only start-up facts)."""
        if self.config.prefix_cache_warmup:
            self.warm_up(self.config.prefix_cache_warmup)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """A tokenizer of the model's folder (or --tokenizer's), with the chat template asked for."""
        folder = self.tokenizer_folder
        return load_tokenizer(folder, self.config.chat_template, named_class=gguf_source(folder) is not None)

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        user: str | None = None,
    ) -> str:
        """Queue one request from raw inputs: `input_processor` checks, truncates and tokenizes it
        (and compiles its grammar) here, then add_processed. Raises ValueError (naming what is
        wrong) before the request touches any engine state."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(
                "n: the engine takes one sequence per request; LLM.generate and the server fan out n"
            )
        req_id = request_id if request_id is not None else str(next(self._request_counter))
        request = self.input_processor.process(
            req_id, prompt, params, arrival_time=arrival_time, cache_salt=cache_salt, user=user
        )
        if params.structured_outputs is not None:
            grammar = self.input_processor.compile_grammar(params.structured_outputs)
            request = dataclasses.replace(request, grammar=grammar)
        return self.add_processed(request)

    def add_processed(self, processed: EngineRequest) -> str:
        """Queue a request an InputProcessor made (the server's, on its event loop): trusted as
        it is, only bookkeeping runs here (the Request, its block hashes, its place in the
        scheduler). Raises ValueError for an id already in use."""
        self._check_new_id(processed.req_id)
        request = Request(
            req_id=processed.req_id,
            prompt_token_ids=list(processed.prompt_token_ids),  # the request's own copy
            sampling_params=processed.sampling_params,
            eos_token_ids=self._eos_token_ids,
            max_tokens=processed.max_tokens,
            prompt=processed.prompt,
            cache_salt=processed.cache_salt,
            user=processed.user,
            arrival_time=processed.arrival_time,
            grammar=RequestGrammar(processed.grammar) if processed.grammar is not None else None,
        )
        self.kv_cache_manager.hash_prompt(request)  # here, where a failure is this request's alone
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)
        return request.req_id

    def _check_new_id(self, req_id: str) -> None:
        if req_id in self.scheduler.requests or self.output_processor.has_request(req_id):
            raise ValueError(f"request_id: {req_id!r} is already in use")

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """End requests now, wherever they are; their blocks go back to the pool at once."""
        ids = list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every running request. A request whose own part fails (its sampling, its
        detokenization) ends with finish_reason "error" and the others go on; anything else raised
        here leaves the engine's state unknown, and the caller must stop using it."""
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
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        processed = self.output_processor.process(core_outputs)
        if processed.stopped:
            self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.scheduler.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
        if self.stats_logger is not None and self.stats_logger.is_due():
            self.stats_logger.log(self.scheduler.make_stats())
        return processed.outputs

    def warm_up(self, path: str) -> None:
        """Compute the prompts of a workload file (its conversations' first turns) into the prefix
        cache, one token each: the first real requests that share them hit.

        Raises:
            ValueError: naming --prefix-cache-warmup and the file, when it cannot be read or
                one of its prompts cannot be served.
        """
        start = time.monotonic()
        try:
            prompts = workload_prompts(self.tokenizer, load_workload(path))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"prefix_cache_warmup: cannot read {path} ({_describe(error)}); give --prefix-cache-warmup "
                "a JSONL file with a prompt (and max_tokens) or a conversation per line"
            ) from None
        for index, prompt_ids in enumerate(prompts):
            try:
                self.add_request(None, {"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=1))
            except ValueError as error:
                raise ValueError(
                    f"prefix_cache_warmup: {path}, prompt {index + 1}: {error}; fix or drop it"
                ) from None
        while self.has_unfinished_requests():
            self.step()
        logger.info(
            "Prefix cache warm-up: %d prompts from %s (%s tokens) in %.1f s",
            len(prompts),
            path,
            f"{sum(map(len, prompts)):,}",
            time.monotonic() - start,
        )

    def close(self) -> None:
        """At a graceful shutdown: every cached block to the disk tier, so a restart starts warm;
        then the other tensor-parallel ranks stop."""
        try:
            self._save_kv_offload()
        finally:
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

    def set_failure_callback(self, on_failure: Callable[[BaseException], None]) -> None:
        """`on_failure` is called, from another thread, if a tensor-parallel rank dies, even
        while no step runs (a step in flight raises by itself)."""
        self.executor.set_failure_callback(on_failure)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def block_tables(self) -> list[tuple[str, str | None, list[int]]]:
        """Every request that holds KV blocks: its id, its caller and its block ids in block-table
        order. Engine thread only (the dashboard's block map reads it between two steps)."""
        requests = self.scheduler.requests
        return [
            (req_id, requests[req_id].user if req_id in requests else None, block_ids)
            for req_id, block_ids in self.kv_cache_manager.block_tables().items()
        ]

    def reset_prefix_cache(self) -> int:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- helpers -------------------------------------------------------------------------------

    def _log_startup_report(self, load_seconds: float) -> None:
        plan: KVCachePlan = self.kv_cache_plan
        device = self.worker.device.type
        by_format = sorted(self.worker.weights_bytes_by_format().items(), key=lambda item: -item[1])
        copy_bytes = self.worker.packed_copy_bytes
        logger.info(  # the formats' sizes add up to the total: a tied head's packed copy is in both
            "Model %s loaded in %.1f s: weights take %.2f GiB%s (%s; %s) on %s%s",
            self.model_name,
            load_seconds,
            (self.worker.weights_bytes + copy_bytes) / 2**30,
            f" on rank 0 of {self.executor.tp_size}" if self.executor.tp_size > 1 else "",
            ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in by_format if size),
            f"activations {str(self.worker.dtype).split('.')[-1]}",
            device,
            f", the tied lm_head's packed copy ({copy_bytes / 2**30:.2f} GiB) included" if copy_bytes else "",
        )
        logger.info(
            "Available KV cache memory: %.2f GiB%s",
            plan.budget_bytes / 2**30,
            " per rank" if self.executor.tp_size > 1 else "",
        )
        scales = plan.spec.scale_bytes_per_token
        logger.info(
            "KV cache: %s blocks of %d tokens, %s bytes per token (%s%s)",
            f"{plan.num_blocks:,}",
            plan.spec.block_size,
            f"{plan.spec.bytes_per_token:,}",
            plan.spec.cache_dtype,
            f", {scales:,} of them scales" if scales else "",
        )
        logger.info("%sKV cache size: %s tokens", "GPU " if device == "cuda" else "", f"{plan.num_tokens:,}")
        if self.executor.tp_size > 1:
            logger.info(
                "KV cache per rank: %s tokens (%s blocks, %.2f GiB, %d of %d KV heads); "
                "total over %d ranks: %.2f GiB",
                f"{plan.num_tokens:,}",
                f"{plan.num_blocks:,}",
                plan.allocated_bytes / 2**30,
                plan.spec.num_kv_heads,
                self.model_config.num_key_value_heads,
                self.executor.tp_size,
                plan.allocated_bytes * self.executor.tp_size / 2**30,
            )
        logger.info(
            "Maximum concurrency for %s tokens per request: %.2fx",
            f"{plan.max_model_len:,}",
            plan.max_concurrency,
        )
        spec = self.config.speculation
        if spec is not None:
            logger.info(
                "Speculative decoding: %s, up to %d draft tokens a request and step (%s), checked in "
                "the batch; fewer where the step's measured cost of a row beats a request's acceptance",
                spec.method,
                spec.num_speculative_tokens,
                f"prompt lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
                if spec.method == "ngram"
                else f"suffix trees of depth {spec.suffix_decoding_max_tree_depth}",
            )


def _describe(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"a line lacks the {error} field"
    return getattr(error, "strerror", None) or str(error) or type(error).__name__
