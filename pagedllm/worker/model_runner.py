"""ModelRunner: the mechanism that executes one scheduled step on the device.

scheduled requests -> input tensors -> model -> logits of the rows to sample -> sampler.
It receives ids and counts (ScheduledRequest), never scheduler objects.
"""

from __future__ import annotations

import torch

from pagedllm.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from pagedllm.model.llama import KVCache, LlamaForCausalLM
from pagedllm.sample.sampler import Sampler, gather_logprobs
from pagedllm.worker.input_builder import build_model_input


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        seed: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(scheduler_output.finished_req_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        model_input = build_model_input(
            scheduler_output.scheduled, self.block_size, self.device, self.model.embed_tokens.weight.dtype
        )
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata
        )
        output = ModelRunnerOutput(sampled_token_ids={})
        for request, first_row, num_rows in model_input.prompt_scoring:
            output.prompt_logprobs[request.req_id] = self._score_prompt(hidden, request, first_row, num_rows)
        if not model_input.sampled:
            return output
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        tokens, logprobs = self.sampler(logits, model_input.sampled)
        req_ids = [r.req_id for r in model_input.sampled]
        output.sampled_token_ids = dict(zip(req_ids, tokens, strict=True))
        output.logprobs = {req_id: lp for req_id, lp in zip(req_ids, logprobs, strict=True) if lp is not None}
        return output

    def _score_prompt(
        self, hidden: torch.Tensor, request: ScheduledRequest, first_row: int, num_rows: int
    ) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens that follow this chunk's rows (teacher forcing)."""
        start = request.num_computed_tokens + 1
        targets = torch.tensor(request.prompt_token_ids[start : start + num_rows], device=hidden.device)
        logits = self.model.compute_logits(hidden[first_row : first_row + num_rows])
        k = request.sampling_params.prompt_logprobs
        return gather_logprobs(torch.log_softmax(logits, dim=-1), targets, [k] * num_rows)  # type: ignore[return-value]
