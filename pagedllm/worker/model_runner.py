"""ModelRunner: the mechanism that executes one scheduled step on the device.

scheduled requests -> request table -> input tensors -> model -> logits of the rows to sample
-> grammar bitmask (structured output) -> sampler. It receives ids, counts and, once per
request, its prompt and settings (SchedulerOutput), never scheduler objects; it keeps its own
copy of each request (request_table.py) and appends the tokens it samples.

Failure isolation: the forward pass is the whole batch's, and an error there propagates (the
engine's state is then unknown). What is one request's own (its sampling settings, its prompt
scoring) fails that request alone: it is named in ModelRunnerOutput.failed and the others go on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from pagedllm.attention.backend import AttentionBackend, select_backend
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.model.llama import KVCache, LlamaForCausalLM
from pagedllm.sample.sampler import Sampler, gather_logprobs
from pagedllm.structured_output.bitmask import apply_bitmask
from pagedllm.worker.input_builder import ModelInput, build_model_input
from pagedllm.worker.request_table import RequestTable, StepRequest, sampling_metadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        seed: int,
        max_num_reqs: int,
        max_model_len: int,
        samples: bool = True,
    ) -> None:
        """`samples`: False on tensor-parallel ranks other than 0, which run the forward pass
        (its all-reduces need them) and leave sampling to rank 0 (with a vocabulary-parallel LM
        head they compute their share of its logits)."""
        self.model = model
        self.samples = samples
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.requests = RequestTable(max_num_reqs, -(-max_model_len // block_size))
        # attention in the CPU kernel, else in PyTorch ops: decided once, from the model and cache
        self.attn_backend: AttentionBackend = select_backend(
            device, model.embed_tokens.weight.dtype, kv_caches[0][0].dtype, model.config.head_dim
        )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(scheduler_output.finished_req_ids)
        batch = self.requests.update(scheduler_output)
        if not batch:
            return ModelRunnerOutput(sampled_token_ids={})
        num_blocks = max(-(-step.seq_len // self.block_size) for step in batch)
        model_input = build_model_input(
            batch,
            self.requests.block_tables(batch, num_blocks),
            self.block_size,
            self.device,
            self.attn_backend,
        )
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata
        )
        output = ModelRunnerOutput(sampled_token_ids={})
        if not self.samples:
            self._logits_for_rank_0(hidden, model_input)
            return output
        for request, first_row, num_rows in model_input.prompt_scoring:
            with _failing_alone(output, request.req_id):
                output.prompt_logprobs[request.req_id] = self._score_prompt(
                    hidden, request, first_row, num_rows
                )
        if model_input.sampled:
            logits = self.model.compute_logits(hidden[model_input.logits_indices])
            assert logits is not None  # rank 0 gets the whole vocabulary
            grammar = scheduler_output.grammar_bitmask
            if grammar is not None:
                output.failed.update(grammar.failed)
                rows = {req.req_id: row for row, req in enumerate(model_input.sampled)}
                apply_bitmask(logits, grammar, rows)
            self._sample(logits, model_input.sampled, output)
        return output

    def _logits_for_rank_0(self, hidden: torch.Tensor, model_input: ModelInput) -> None:
        """Tensor-parallel ranks but 0, with a vocabulary-parallel head: their share of every
        logits rank 0 computes this step, in the same order (prompt scoring, then sampling)."""
        if not self.model.lm_head.vocab_parallel:
            return
        for _, first_row, num_rows in model_input.prompt_scoring:
            self.model.compute_logits(hidden[first_row : first_row + num_rows])
        if model_input.sampled:
            self.model.compute_logits(hidden[model_input.logits_indices])

    def _sample(self, logits: torch.Tensor, reqs: list[StepRequest], output: ModelRunnerOutput) -> None:
        """Sample the batch at once; if that raises, each request alone, so only the ones at
        fault fail. logits: [len(reqs), vocab]."""
        try:
            tokens, logprobs = self.sampler(logits, sampling_metadata(reqs))
        except Exception:
            logger.warning("Batched sampling failed; sampling the %d requests one by one", len(reqs))
            for row, req in enumerate(reqs):
                with _failing_alone(output, req.req_id):
                    alone = sampling_metadata([req])
                    self._record(output, *self.sampler(logits[row : row + 1], alone), [req])
            return
        self._record(output, tokens, logprobs, reqs)

    @staticmethod
    def _record(
        output: ModelRunnerOutput, tokens: list[int], logprobs: list, reqs: list[StepRequest]
    ) -> None:
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            output.sampled_token_ids[req.req_id] = token
            req.state.output_token_ids.append(token)  # the runner's copy grows as the scheduler's
            if lp is not None:
                output.logprobs[req.req_id] = lp

    def _score_prompt(
        self, hidden: torch.Tensor, request: StepRequest, first_row: int, num_rows: int
    ) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens that follow this chunk's rows (teacher forcing)."""
        # logits first: with a vocabulary-parallel head they are a gather every rank joins
        logits = self.model.compute_logits(hidden[first_row : first_row + num_rows])
        start = request.num_computed_tokens + 1
        targets = torch.tensor(request.prompt_token_ids[start : start + num_rows], device=hidden.device)
        assert logits is not None
        k = request.sampling_params.prompt_logprobs
        return gather_logprobs(torch.log_softmax(logits, dim=-1), targets, [k] * num_rows)  # type: ignore[return-value]


@contextlib.contextmanager
def _failing_alone(output: ModelRunnerOutput, req_id: str) -> Iterator[None]:
    """One request's own work: an error in it fails that request (logged), not the step."""
    try:
        yield
    except Exception as error:
        logger.exception("Request %s failed; the others go on", req_id)
        output.failed[req_id] = f"{type(error).__name__}: {error}"
