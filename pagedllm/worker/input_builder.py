"""Turn a step (rows of the input batch and their token counts) into model inputs: flat token ids,
positions, slots, attention metadata and the rows to sample from. All index arithmetic is done
once per step in a handful of numpy ops over the batch's row arrays, never per token in Python.

Flat layout of a step (requests in scheduled order, each contributing its new tokens):

    rows:      0   1   2   3 4 5 6 7   8 9 10
    request:   A   B   C   D D D D D   E E E      A, B, C decode; D, E prefill chunks
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, StepLayout
from pagedllm.worker.input_batch import InputBatch


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows whose logits are sampled: len(draft) + 1 per sampled request
    sampled_rows: list[int]
    """The input batch's rows of the sampling requests, in the order of their logits."""
    drafts: list[list[int]]
    """Per sampling request, the draft tokens it checks (speculative decoding; mostly empty)."""
    prompt_scoring: list[tuple[int, int, int]]
    """(batch row, first flat row, number of flat rows) whose next token is a prompt token, for
    requests asking for prompt_logprobs."""


def build_model_input(
    batch: InputBatch,
    rows: list[int],
    counts: list[int],
    block_size: int,
    device: torch.device,
    attn_backend: AttentionBackend,
    drafts: list[list[int]] | None = None,
) -> ModelInput:
    """rows: the batch rows of the step's requests, in step order; counts: their tokens this
    step, the last known one and then draft tokens `drafts[i]` where given (written after the
    known tokens in the batch's rows). attn_backend builds the attention metadata its path reads."""

    index = np.array(rows, dtype=np.int64)
    counts_a = np.array(counts, dtype=np.int64)
    starts_a = batch.num_computed_tokens[index]
    seq_lens_a = starts_a + counts_a
    seq_lens = seq_lens_a.tolist()
    num_blocks = -(-max(seq_lens) // block_size)
    block_tables = batch.block_table[index, :num_blocks]

    row_offsets = np.cumsum(counts_a) - counts_a  # first flat row of each request
    req_of_token = np.repeat(np.arange(len(rows)), counts_a)  # [num_tokens]
    num_tokens = int(counts_a.sum())
    positions = np.arange(num_tokens) - row_offsets[req_of_token] + starts_a[req_of_token]
    slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = batch.token_ids[index[req_of_token], positions].astype(np.int64)
    row_offset_list = row_offsets.tolist()
    layout = StepLayout(
        torch.from_numpy(slot_mapping),
        counts,
        starts_a.tolist(),
        seq_lens,
        row_offset_list,
        torch.from_numpy(block_tables),
        block_size,
    )
    attn_metadata = attn_backend.build_metadata(layout, device)
    # a request samples when this step reaches its last known token (and its drafts after it)
    known = batch.num_tokens[index]
    if drafts is None:
        samples = (seq_lens_a == known).tolist()
        sampled = [i for i in range(len(rows)) if samples[i]]
        last_rows = [row_offset_list[i] + counts[i] - 1 for i in sampled]
        drafts = [[] for _ in rows]
    else:
        samples = (seq_lens_a == known + np.array([len(d) for d in drafts], dtype=np.int64)).tolist()
        sampled = [i for i in range(len(rows)) if samples[i]]
        last_rows = [
            row_offset_list[i] + counts[i] - 1 - j for i in sampled for j in range(len(drafts[i]), -1, -1)
        ]
    logits_indices = torch.tensor(last_rows, dtype=torch.long)

    prompt_scoring = []
    for i, row in enumerate(rows):
        if batch.num_prompt_logprobs[row] is None:
            continue
        start, last_prompt = int(starts_a[i]), int(batch.num_prompt_tokens[row]) - 1
        if start < last_prompt:
            prompt_scoring.append((row, row_offset_list[i], min(seq_lens[i], last_prompt) - start))
    return ModelInput(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=attn_metadata,
        logits_indices=logits_indices.to(device),
        sampled_rows=[rows[i] for i in sampled],
        drafts=[drafts[i] for i in sampled],
        prompt_scoring=prompt_scoring,
    )
