"""ModelRunner: the mechanism that executes one scheduled step on the device.

scheduled requests -> input tensors -> model -> logits of the rows to sample -> sampler.
It receives ids and counts (ScheduledRequest), never scheduler objects.
"""

from __future__ import annotations

import torch

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.model.llama import KVCache, LlamaForCausalLM
from pagedllm.sample.sampler import Sampler
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
        model_input = build_model_input(scheduler_output.scheduled, self.block_size, self.device)
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata
        )
        if not model_input.sampled:
            return ModelRunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        tokens, logprobs = self.sampler(logits, model_input.sampled)
        req_ids = [r.req_id for r in model_input.sampled]
        return ModelRunnerOutput(
            sampled_token_ids=dict(zip(req_ids, tokens, strict=True)),
            logprobs={req_id: lp for req_id, lp in zip(req_ids, logprobs, strict=True) if lp is not None},
        )
