"""Turn a step's requests (from the runner's request table) into model inputs: flat token ids,
positions, slots, attention metadata and the rows to sample from. All index arithmetic is done
once per step in a handful of tensor ops, never per token in Python.

Flat layout of a step (requests in scheduled order, each contributing its new tokens):

    rows:      0   1   2   3 4 5 6 7   8 9 10
    request:   A   B   C   D D D D D   E E E      A, B, C decode; D, E prefill chunks
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.request_table import StepRequest


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows whose logits are sampled
    sampled: list[StepRequest]  # the requests those rows belong to, same order
    prompt_scoring: list[tuple[StepRequest, int, int]]
    """(request, first row, number of rows) whose next token is a prompt token, for
    requests asking for prompt_logprobs."""


def build_model_input(
    scheduled: list[StepRequest],
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
    attn_backend: AttentionBackend,
) -> ModelInput:
    """block_tables: [len(scheduled), >= the most blocks any of them uses this step];
    attn_backend builds the attention metadata its path reads."""
    num_reqs = len(scheduled)
    counts = [s.num_scheduled_tokens for s in scheduled]
    starts = [s.num_computed_tokens for s in scheduled]
    seq_lens = [s.seq_len for s in scheduled]

    counts_t = torch.tensor(counts)
    row_offsets = torch.cumsum(counts_t, 0) - counts_t  # first row of each request
    req_of_row = torch.repeat_interleave(torch.arange(num_reqs), counts_t)  # [num_tokens]
    num_tokens = int(counts_t.sum())
    positions = torch.arange(num_tokens) - row_offsets[req_of_row] + torch.tensor(starts)[req_of_row]
    slot_mapping = block_tables[req_of_row, positions // block_size] * block_size + positions % block_size

    input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.long)
    row_offset_list = row_offsets.tolist()
    attn_metadata = attn_backend.build_metadata(
        slot_mapping, counts, starts, seq_lens, row_offsets, block_tables, block_size, device
    )
    sampled_idx = [i for i in range(num_reqs) if scheduled[i].do_sample]
    logits_indices = torch.tensor([row_offset_list[i] + counts[i] - 1 for i in sampled_idx], dtype=torch.long)

    return ModelInput(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        attn_metadata=attn_metadata,
        logits_indices=logits_indices.to(device),
        sampled=[scheduled[i] for i in sampled_idx],
        prompt_scoring=[
            (s, row_offset_list[i], min(s.seq_len, len(s.prompt_token_ids) - 1) - s.num_computed_tokens)
            for i, s in enumerate(scheduled)
            if s.sampling_params.prompt_logprobs is not None
            and s.num_computed_tokens < len(s.prompt_token_ids) - 1
        ],
    )
