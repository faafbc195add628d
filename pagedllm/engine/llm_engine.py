"""LLMEngine: the offline front end. Prompts in, one step at a time, RequestOutputs out.

    add_request: InputProcessor.process (check, truncate, tokenize; the grammar) -> EngineRequest
                 -> EngineCore.add_request (bookkeeping) and OutputProcessor.add_request
    step:        EngineCore.step (token ids) -> OutputProcessor (text, stop strings) -> outputs;
                 the requests a stop string or a failed output ended go back to the core at once

The core (engine/core.py) holds the scheduler, the KV cache and the ranks, and knows no tokenizer;
this front end owns the tokenizer, both processors, the periodic stats line and the warm-up, and
learns the model's limits from `core.facts`. The offline LLM class drives it; it is not
thread-safe: one thread calls it. (The server's front end is AsyncLLM, over its own core.)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.front_step import abort_outputs, add_to_core, step_outputs
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.messages import EngineRequest
from pagedllm.engine.model_source import ModelSource
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.warm_up import warm_up
from pagedllm.lora.checker import lora_checker_for
from pagedllm.lora_request import LoRARequest
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.metrics.stats_logger import StatsLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Resolve the model, load the tokenizer (first: a broken one fails before the weights
        load), start the core, then this front end's parts; a failure after the core started
        stops its ranks."""
        source = ModelSource.resolve(config)
        self.tokenizer_folder = source.tokenizer_folder
        self.tokenizer = source.load_tokenizer(config.chat_template)
        self.core = EngineCore(config, source, decode=self.tokenizer.decode)
        """The scheduler, the KV cache and the ranks (tests and benchmarks look inside)."""
        try:
            self._set_up()
        except BaseException:
            self.core.shutdown()  # ranks 1.. must not wait for a step that never comes
            raise

    def _set_up(self) -> None:
        self.facts = self.core.facts
        self.config = self.core.config
        """The config in effect: max_model_len resolved."""
        self.input_processor = InputProcessor.for_model(
            self.facts,
            self.tokenizer,
            self.config.max_logprobs,
            lora_checker_for(self.config, self.facts.model_config),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, speculative=self.config.speculation is not None
        )
        self.stats_logger = (
            None
            if self.config.disable_log_stats
            else StatsLogger(self.config.log_stats_interval, self.config.enable_prefix_caching)
        )
        self._request_counter = itertools.count()
        if self.config.prefix_cache_warmup:
            self.warm_up(self.config.prefix_cache_warmup)

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

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
        lora_request: LoRARequest | None = None,
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
            req_id,
            prompt,
            params,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            user=user,
            lora_request=lora_request,
        )
        if params.structured_outputs is not None:
            grammar = self.input_processor.compile_grammar(params.structured_outputs)
            request = dataclasses.replace(request, grammar=grammar)
        return self.add_processed(request)

    def add_processed(self, processed: EngineRequest) -> str:
        """Queue a request an InputProcessor made: the core's bookkeeping, then this front end's
        detokenizer for it. Raises ValueError for an id already in use."""
        return add_to_core(self.core, self.output_processor, processed)

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """End requests now, wherever they are; their blocks go back to the pool at once."""
        return abort_outputs(self.core, self.output_processor, list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.get_num_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every running request. A request whose own part fails (its sampling, its
        detokenization) ends with finish_reason "error" and the others go on; anything else raised
        here leaves the engine's state unknown, and the caller must stop using it."""
        return step_outputs(self.core, self.output_processor, self.stats_logger)

    def warm_up(self, path: str) -> None:
        """--prefix-cache-warmup: the workload file's prompts into the prefix cache (engine/warm_up.py)."""
        params = SamplingParams(max_tokens=1)
        warm_up(
            path,
            self.tokenizer,
            lambda prompt_ids: self.add_request(None, {"prompt_token_ids": prompt_ids}, params),
            self._run_to_end,
        )

    def _run_to_end(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    def close(self) -> None:
        """At a graceful shutdown: the disk tier written, then the other ranks stopped (EngineCore.close)."""
        self.core.close()

    def set_failure_callback(self, on_failure: Callable[[BaseException], None]) -> None:
        """`on_failure` is called, from another thread, if a tensor-parallel rank dies."""
        self.core.set_failure_callback(on_failure)

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> int:
        """Drop every cached-but-free block. Returns how many were dropped."""
        return self.core.reset_prefix_cache()
