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

from pagedllm.attention.metadata import AttentionMetadata, DecodeBatch, PagedKernelInput, PrefillSpan
from pagedllm.worker.request_table import StepRequest

# Decodes are grouped by context length so one long request does not make every short one
# pay its padding: a group ends where the next context is over twice the group's shortest,
# so padding never doubles the keys a group reads (a few such groups beat one padded call:
# docs/benchmarks.md, "Figures behind choices in the code").


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
    dtype: torch.dtype,
    paged_kernel: bool = False,
) -> ModelInput:
    """block_tables: [len(scheduled), >= the most blocks any of them uses this step]. dtype: the
    model's, for the additive attention masks. paged_kernel: attention runs in the CPU kernel
    (metadata for it alone), else in PyTorch ops (decode batches, prefill spans)."""
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
    if paged_kernel:  # one call takes every token: no groups, spans or masks to build
        query_start_loc = torch.cat([row_offsets, torch.tensor([num_tokens])])
        kernel = PagedKernelInput(block_tables, query_start_loc, torch.tensor(seq_lens))
        attn_metadata = AttentionMetadata(slot_mapping.to(device), [], [], kernel)
    else:
        attn_metadata = _pytorch_metadata(
            slot_mapping, counts, starts, seq_lens, row_offset_list, block_tables, block_size, device, dtype
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


def _pytorch_metadata(
    slot_mapping: torch.Tensor,
    counts: list[int],
    starts: list[int],
    seq_lens: list[int],
    row_offsets: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """Decode batches grouped by length and one span per prefill chunk, for the PyTorch path."""
    decode_reqs = [i for i in range(len(counts)) if counts[i] == 1]
    decode_batches = [
        _decode_batch(group, row_offsets, seq_lens, block_tables, block_size, device)
        for group in _group_by_length(decode_reqs, seq_lens)
    ]
    prefills = [
        _prefill_span(i, row_offsets[i], counts[i], starts[i], block_tables, block_size, device, dtype)
        for i in range(len(counts))
        if counts[i] > 1
    ]
    return AttentionMetadata(slot_mapping.to(device), decode_batches, prefills)


def _group_by_length(req_indices: list[int], seq_lens: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in sorted(req_indices, key=seq_lens.__getitem__):
        if groups and seq_lens[i] <= 2 * seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_batch(
    group: list[int],
    row_offsets: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> DecodeBatch:
    group_seq_lens = torch.tensor([seq_lens[i] for i in group])
    num_blocks = -(-int(group_seq_lens.max()) // block_size)
    tables = block_tables[torch.tensor(group), :num_blocks]
    key_positions = torch.arange(num_blocks * block_size)
    mask = (key_positions[None, :] < group_seq_lens[:, None])[:, None, None, :]
    return DecodeBatch(
        token_indices=torch.tensor([row_offsets[i] for i in group], dtype=torch.long).to(device),
        block_tables=tables.to(device),
        seq_lens=group_seq_lens.to(device),
        attend_mask=mask.to(device),
    )


def _prefill_span(
    req: int,
    row_offset: int,
    count: int,
    start: int,
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> PrefillSpan:
    if start == 0:
        return PrefillSpan(row_offset, row_offset + count, 0, None, None)
    seq_len = start + count
    num_blocks = -(-seq_len // block_size)
    query_positions = torch.arange(start, seq_len)
    visible = torch.arange(seq_len)[None, :] <= query_positions[:, None]  # [chunk, seq_len]
    # additive, in the model's dtype: SDPA adds it as it is, where a boolean mask would be
    # converted again in every layer
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return PrefillSpan(
        row_offset, row_offset + count, start, block_tables[req, :num_blocks].to(device), mask.to(device)
    )
