"""The runner's persistent batch: every request it holds, one row each, from its first step to its
last (vLLM's v1/worker/gpu_input_batch.py, updated from the delta of v1/core/sched/output.py).

The scheduler sends a request whole once (NewRequestData), then each step only what changed
(CachedRequestData: new block ids, computed counts). The batch writes those into row arrays in
place: token ids (the prompt, then each sampled token at its position), counts, block ids and
sampling settings. A step is then a list of rows: its input ids, its sampling settings and its
penalties' tokens are gathers from these arrays, not lists rebuilt in Python.

    step N:   finished / preempted ids -> rows freed       new requests -> rows taken, filled
              cached requests -> computed counts set, new block ids written after their last
              sampled tokens -> written at each row's end, its count + 1

A request's tokens this step are positions num_computed.. of its row, however many: a prefill
chunk, or a decode with proposed tokens written after its last one (speculative decoding) read
the same way. A preempted request gives its row back and gets one again when it resumes; its
seeded generator lives on until it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagedllm.core.outputs import NewRequestData, SchedulerOutput
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sample.metadata import Penalties, SamplingMetadata


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # numpy arrays, not tensors: a step's index arithmetic on a few rows runs in a fraction of
        # the time torch's dispatcher takes per op, more so right after the weights' stream has
        # evicted the caches (tensors for the model and sampler are made with torch.from_numpy)
        # token ids, counts and blocks, one row per request
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        """Row r: its request's prompt, then its output tokens; the rest is stale."""
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Prompt and output tokens known: the next sampled one goes at this position."""
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        """Row r: its request's block ids, then zeros."""
        self._num_blocks = [0] * max_num_reqs
        # sampling settings, one entry per row; the rare ones in dicts by row
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.full(max_num_reqs, vocab_size, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self._greedy = [True] * max_num_reqs
        self._cuts_top = [False] * max_num_reqs
        """The row cuts by top-k or top-p."""
        self._penalized = [False] * max_num_reqs
        self._logit_bias: dict[int, dict[int, float]] = {}
        self._min_tokens: dict[int, tuple[int, list[int]]] = {}
        """Row -> (min_tokens, the stop and end-of-sequence ids banned until then)."""
        self.pooling: dict[int, PoolingParams] = {}
        """Row -> the settings of an embedding request (pooled where it would sample)."""
        self.lora: dict[int, LoRARequest] = {}
        """Row -> the adapter its request runs under (rows of the base model are not here)."""
        self._num_logprobs: list[int | None] = [None] * max_num_reqs
        self.num_prompt_logprobs: list[int | None] = [None] * max_num_reqs
        self.generators: dict[str, torch.Generator] = {}
        """Seeded requests' own generators, by request id: kept through a preemption."""
        self.req_ids: list[str] = [""] * max_num_reqs
        """Row -> its request's id (empty: a free row)."""
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._last_metadata: tuple[tuple[int, ...], SamplingMetadata] | None = None
        """The rows and the sampling metadata last gathered for them, where no part of it moves
        from step to step (no penalties, no min_tokens ban): a decode step reuses it until a row
        is taken or given back."""

    # ---- the step's delta ----------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's delta: rows freed, rows taken, counts and blocks of held rows set."""
        self._remove(scheduler_output.finished_req_ids, finished=True)
        self._remove(scheduler_output.preempted_req_ids, finished=False)
        for new in scheduler_output.new_requests:
            self._add(new)
        cached = scheduler_output.cached_requests
        rows = [self.row_of[req_id] for req_id in cached.req_ids]
        if rows:
            self.num_computed_tokens[rows] = cached.num_computed_tokens
        for row, block_ids in zip(rows, cached.new_block_ids, strict=True):
            if block_ids:
                self._append_blocks(row, block_ids)
        for req_id, draft in scheduler_output.scheduled_spec_decode_tokens.items():
            row, end = self.row_of[req_id], int(self.num_tokens[self.row_of[req_id]])
            self.token_ids[row, end : end + len(draft)] = draft

    def append_tokens(self, rows: list[int], token_ids: list[list[int]]) -> None:
        """Sampled tokens (by this runner, or by rank 0 with tensor parallelism), a list per row
        (more than one where speculative decoding accepted draft tokens)."""
        for row, tokens in zip(rows, token_ids, strict=True):
            end = int(self.num_tokens[row])
            self.token_ids[row, end : end + len(tokens)] = tokens
            self.num_tokens[row] = end + len(tokens)

    def speculates(self, row: int) -> bool:
        """Whether draft tokens may be proposed for this row now: once min_tokens (which bans
        tokens by position) is reached."""
        entry = self._min_tokens.get(row)
        return entry is None or int(self.num_tokens[row] - self.num_prompt_tokens[row]) >= entry[0]

    # ---- what a step reads ---------------------------------------------------------------------

    def sampling_metadata(self, rows: list[int], drafts_before: list[int] | None = None) -> SamplingMetadata:
        """The sampler's view of these rows, in this order (the order of the logits' rows).
        drafts_before (speculative decoding): per logits row, how many of its request's draft
        tokens come before that position; penalties count them as output there."""
        key = tuple(rows)
        if drafts_before is None and self._last_metadata is not None and self._last_metadata[0] == key:
            return self._last_metadata[1]
        metadata = self._gather_sampling_metadata(rows, drafts_before)
        if drafts_before is None and metadata.penalties is None and metadata.banned is None:
            self._last_metadata = (key, metadata)
        return metadata

    def _gather_sampling_metadata(self, rows: list[int], drafts_before: list[int] | None) -> SamplingMetadata:
        index = np.array(rows, dtype=np.int64)
        is_greedy = [self._greedy[row] for row in rows]
        cuts_top = any(self._cuts_top[row] for row in rows)
        min_p = self.min_p[index]
        return SamplingMetadata(
            all_greedy=all(is_greedy),
            is_greedy=torch.tensor(is_greedy),
            temperature=torch.from_numpy(self.temperature[index]),
            top_k=torch.from_numpy(self.top_k[index]) if cuts_top else None,
            top_p=torch.from_numpy(self.top_p[index]) if cuts_top else None,
            min_p=torch.from_numpy(min_p) if min_p.any() else None,
            generators={
                i: generator
                for i, row in enumerate(rows)
                if (generator := self.generators.get(self.req_ids[row])) is not None
            },
            penalties=self._penalties(
                [i for i, row in enumerate(rows) if self._penalized[row]], index, drafts_before
            ),
            logit_bias=self._logit_biases(rows),
            banned=self._banned(rows),
            num_logprobs=[self._num_logprobs[row] for row in rows],
        )

    def _penalties(
        self, positions: list[int], index: np.ndarray, drafts_before: list[int] | None
    ) -> Penalties | None:
        if not positions:
            return None
        rows = index[positions]
        num_prompt, num_tokens = self.num_prompt_tokens[rows][:, None], self.num_tokens[rows][:, None]
        if drafts_before is not None:  # the drafts follow the known tokens in the row
            num_tokens = num_tokens + np.array([drafts_before[i] for i in positions])[:, None]
        length = int(num_tokens.max())
        column = np.arange(length)[None, :]
        return Penalties(
            rows=torch.tensor(positions),
            token_ids=torch.from_numpy(self.token_ids[rows, :length].astype(np.int64)),
            is_prompt=torch.from_numpy(column < num_prompt),
            is_output=torch.from_numpy((column >= num_prompt) & (column < num_tokens)),
            repetition=torch.from_numpy(self.repetition_penalty[rows][:, None]),
            frequency=torch.from_numpy(self.frequency_penalty[rows][:, None]),
            presence=torch.from_numpy(self.presence_penalty[rows][:, None]),
        )

    def _logit_biases(self, rows: list[int]) -> tuple[list[int], list[int], list[float]] | None:
        if not self._logit_bias:
            return None
        positions, cols, biases = [], [], []
        for i, row in enumerate(rows):
            for token_id, bias in self._logit_bias.get(row, {}).items():
                positions.append(i)
                cols.append(token_id)
                biases.append(bias)
        return (positions, cols, biases) if positions else None

    def _banned(self, rows: list[int]) -> tuple[list[int], list[int]] | None:
        if not self._min_tokens:
            return None
        positions: list[int] = []
        cols: list[int] = []
        for i, row in enumerate(rows):
            entry = self._min_tokens.get(row)
            if entry is not None and int(self.num_tokens[row] - self.num_prompt_tokens[row]) < entry[0]:
                positions += [i] * len(entry[1])
                cols += entry[1]
        return (positions, cols) if positions else None

    # ---- helpers -------------------------------------------------------------------------------

    def _remove(self, req_ids: Iterable[str], finished: bool) -> None:
        """Give the rows of these requests back; a finished one's generator goes too."""
        for req_id in req_ids:
            self._last_metadata = None
            if finished:
                self.generators.pop(req_id, None)
            row = self.row_of.pop(req_id, None)
            if row is None:
                continue
            self.req_ids[row] = ""
            self._logit_bias.pop(row, None)
            self._min_tokens.pop(row, None)
            self.pooling.pop(row, None)
            self.lora.pop(row, None)
            self._free_rows.append(row)

    def _add(self, new: NewRequestData) -> None:
        self._last_metadata = None
        row = self._free_rows.pop()
        self.req_ids[row] = new.req_id
        self.row_of[new.req_id] = row
        num_prompt, num_output = len(new.prompt_token_ids), len(new.output_token_ids)
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        if num_output:
            self.token_ids[row, num_prompt : num_prompt + num_output] = new.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_prompt + num_output
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row] = 0
        self._num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        self._set_sampling(row, new)
        if new.lora_request is not None:
            self.lora[row] = new.lora_request

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        end = self._num_blocks[row] + len(block_ids)
        self.block_table[row, self._num_blocks[row] : end] = block_ids
        self._num_blocks[row] = end

    def _set_sampling(self, row: int, new: NewRequestData) -> None:
        params = new.sampling_params
        self._greedy[row] = params.is_greedy
        self.temperature[row] = 1.0 if params.is_greedy else params.temperature
        self.top_k[row] = min(params.top_k or self.vocab_size, self.vocab_size)
        self.top_p[row] = params.top_p
        self._cuts_top[row] = int(self.top_k[row]) < self.vocab_size or params.top_p < 1.0
        self.min_p[row] = params.min_p
        self._penalized[row] = params.has_penalties
        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        if params.logit_bias:
            self._logit_bias[row] = params.logit_bias
        if params.pooling is not None:
            self.pooling[row] = params.pooling
        banned = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            banned |= new.eos_token_ids
        if params.min_tokens > 0 and banned:
            self._min_tokens[row] = (params.min_tokens, sorted(banned))
        self._num_logprobs[row] = params.logprobs
        self.num_prompt_logprobs[row] = params.prompt_logprobs
        if params.seed is not None and new.req_id not in self.generators:
            self.generators[new.req_id] = torch.Generator(device=self.device).manual_seed(params.seed)
