"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text, logprobs, metrics).

It owns each live request's detokenizer. A stop string found here ends the request, which
the engine then tells the scheduler so its blocks are freed in the same step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedllm.core.outputs import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    embedding: list[float] | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    """Requests a stop string just finished: the engine must end them in the scheduler."""
    failed: list[str] = field(default_factory=list)
    """Requests that failed here: the engine must end them in the scheduler too."""


class OutputProcessor:
    def __init__(self, tokenizer, speculative: bool = False) -> None:
        """speculative: outputs carry each request's draft token counts."""
        self.tokenizer = tokenizer
        self.speculative = speculative
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        wants_logprobs = request.sampling_params.logprobs is not None
        self._states[request.req_id] = _RequestState(
            request=request,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling_params
            ),
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
            prompt_logprobs=None if request.sampling_params.prompt_logprobs is None else [None],
        )

    def has_request(self, req_id: str) -> bool:
        return req_id in self._states

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """RequestOutputs of a step. A request whose text cannot be made (its detokenization
        or logprobs raised) fails alone: its output says so, and it is listed in `failed`."""
        processed = ProcessedOutputs()
        for core in core_outputs:
            state = self._states.get(core.req_id)
            if state is None:
                continue
            try:
                self._apply(state, core, processed)
            except Exception as error:
                logger.exception("Request %s failed while making its output; the others go on", core.req_id)
                core.finish_reason, core.stop_reason = RequestStatus.FINISHED_ERROR.finish_reason, None
                core.error = f"{type(error).__name__}: {error}"
                processed.failed.append(core.req_id)
            state.finish_reason, state.stop_reason, state.error = (
                core.finish_reason,
                core.stop_reason,
                core.error,
            )
            processed.outputs.append(self._make_output(state))
            if core.finish_reason is not None:
                del self._states[core.req_id]
        return processed

    def _apply(self, state: _RequestState, core: EngineCoreOutput, processed: ProcessedOutputs) -> None:
        if core.pooled is not None:
            state.embedding = core.pooled
        stop = state.detokenizer.append(core.new_token_ids)
        state.token_ids.extend(core.new_token_ids[: state.detokenizer.num_taken])
        if stop is not None and core.finish_reason is None:
            processed.stopped.append(core.req_id)
        if stop is not None:
            core.finish_reason, core.stop_reason = "stop", stop
        if state.logprobs is not None:
            self._append_logprobs(state, core.new_logprobs[: state.detokenizer.num_taken])
        if state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._to_dicts(core.new_prompt_logprobs))

    def abort(self, req_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for req_id in req_ids:
            state = self._states.pop(req_id, None)
            if state is not None:
                state.finish_reason = "abort"
                outputs.append(self._make_output(state))
        return outputs

    def _append_logprobs(self, state: _RequestState, entries: list[TokenLogprobs]) -> None:
        assert state.logprobs is not None and state.cumulative_logprob is not None
        for entry in entries:
            state.cumulative_logprob += entry.logprobs[0]
        state.logprobs.extend(self._to_dicts(entries))

    def _to_dicts(self, entries: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        return [
            {
                token_id: Logprob(lp, rank, self.tokenizer.decode([token_id]))
                for token_id, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True)
            }
            for entry in entries
        ]

    def _make_output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        finished = state.finish_reason is not None
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.visible_text(finished),
            token_ids=list(state.token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=request.req_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=request.metrics,
            num_cached_tokens=request.num_cached_tokens or 0,
            prompt_logprobs=state.prompt_logprobs,
            error=state.error,
            num_preemptions=request.num_preemptions,
            embedding=state.embedding,
            draft_tokens=(request.num_draft_tokens, request.num_accepted_tokens)
            if self.speculative
            else None,
        )
