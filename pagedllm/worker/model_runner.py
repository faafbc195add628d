"""ModelRunner: the mechanism that executes one scheduled step on the device.

the step's delta -> input batch -> input tensors -> model -> logits of the rows to sample (an
embedding request's row pooled instead: pooling_params.py) -> grammar bitmask (structured output)
-> sampler (with speculative decoding, also the check of draft tokens and the proposals for the
next step: spec_decode/runner_step.py). It receives
ids, counts and, once per request, its prompt and settings (SchedulerOutput), never scheduler
objects; it keeps its own copy of each request, a row of its input batch (input_batch.py), and
appends the tokens it samples there.

Failure isolation: the forward pass is the whole batch's, and an error there propagates (the
engine's state is then unknown). What is one request's own (its sampling settings, its prompt
scoring) fails that request alone: it is named in ModelRunnerOutput.failed and the others go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch

from pagedllm.attention.backend import AttentionBackend, select_backend
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.lora.manager import LoRAManager
from pagedllm.model.llama import KVCache, LlamaForCausalLM
from pagedllm.sample.sampler import Sampler, gather_logprobs
from pagedllm.spec_decode.proposer import make_proposer
from pagedllm.spec_decode.runner_step import SpecDecodeStep, first_logits_rows
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.structured_output.bitmask import GrammarBitmask, apply_bitmask
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_builder import ModelInput, build_model_input

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
        speculation: SpeculativeConfig | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        """`samples`: False on tensor-parallel ranks other than 0, which run the forward pass
        (its all-reduces need them) and leave sampling to rank 0 (with a vocabulary-parallel LM
        head they compute their share of its logits). `speculation`: propose draft tokens after
        each step for the requests that sampled (rank 0 only). `lora`: the adapters, with
        --enable-lora."""
        self.model = model
        self.lora = lora
        self.samples = samples
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.spec_decode: SpecDecodeStep | None = None
        if speculation is not None and samples:
            self.spec_decode = SpecDecodeStep(speculation, make_proposer(speculation), self.sampler)
        self.input_batch = InputBatch(
            max_num_reqs,
            max_model_len,
            -(-max_model_len // block_size),
            model.config.vocab_size,
            device,
        )
        # attention in the CPU kernel, else in PyTorch ops: decided once, from the model and cache
        self.attn_backend: AttentionBackend = select_backend(
            device, model.embed_tokens.weight.dtype, kv_caches[0][0].dtype, model.config.head_dim
        )

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Tokens sampled elsewhere (tensor parallelism: by rank 0) for requests held here; a
        request finished or preempted since is not held, and its tokens are dropped."""
        row_of = self.input_batch.row_of
        held = [(row_of[req_id], tokens) for req_id, tokens in sampled_token_ids.items() if req_id in row_of]
        if held:
            self.input_batch.append_tokens([row for row, _ in held], [tokens for _, tokens in held])

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        batch = self.input_batch
        batch.update(scheduler_output)
        if self.spec_decode is not None:
            self.spec_decode.finish(scheduler_output.finished_req_ids)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput(sampled_token_ids={})
        spec = scheduler_output.scheduled_spec_decode_tokens
        req_ids = list(scheduler_output.num_scheduled_tokens)
        counts = list(scheduler_output.num_scheduled_tokens.values())
        output = ModelRunnerOutput(sampled_token_ids={})
        if self.lora is not None:  # each adapter's requests one run of rows
            adapters = [batch.lora.get(batch.row_of[req_id]) for req_id in req_ids]
            order, failed = self.lora.arrange(adapters, counts)
            output.failed.update({req_ids[i]: error for i, error in failed.items()})
            req_ids, counts = [req_ids[i] for i in order], [counts[i] for i in order]
        model_input = build_model_input(
            batch,
            [batch.row_of[req_id] for req_id in req_ids],
            counts,
            self.block_size,
            self.device,
            self.attn_backend,
            [spec.get(req_id, []) for req_id in req_ids] if spec else None,
        )
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata
        )
        model_input, pooled = self._split_pooled(model_input)
        if not self.samples:
            self._logits_for_rank_0(hidden, model_input, pooled)
            return output
        if pooled:
            self._pool(hidden, pooled, output)
        for row, first, num_rows in model_input.prompt_scoring:
            with _failing_alone(output, batch.req_ids[row]):
                output.prompt_logprobs[batch.req_ids[row]] = self._score_prompt(hidden, row, first, num_rows)
        if model_input.sampled_rows:
            logits = self.model.compute_logits(hidden[model_input.logits_indices])
            assert logits is not None  # rank 0 gets the whole vocabulary
            first_logits = first_logits_rows(model_input.drafts)
            if grammar_bitmask is not None:  # a row per position a constrained request samples at
                output.failed.update(grammar_bitmask.failed)
                output.grammar_dead_ends = grammar_bitmask.dead_ends
                position = {
                    batch.req_ids[row]: first_logits[i] for i, row in enumerate(model_input.sampled_rows)
                }
                apply_bitmask(logits, grammar_bitmask, position)
            plain = [i for i, draft in enumerate(model_input.drafts) if not draft]
            if len(plain) == len(model_input.sampled_rows):
                self._sample(logits, model_input.sampled_rows, output)
            else:
                if plain:
                    rows = [model_input.sampled_rows[i] for i in plain]
                    self._sample(logits[[first_logits[i] for i in plain]], rows, output)
                self._verify(logits, first_logits, model_input, output)
            if self.spec_decode is not None:
                sampled = output.sampled_token_ids
                proposals = self.spec_decode.propose(batch, model_input.sampled_rows, sampled)
                output.spec_token_ids.update(proposals)
        return output

    def _split_pooled(self, model_input: ModelInput) -> tuple[ModelInput, list[tuple[int, int]]]:
        """The step's sampling rows less those of embedding requests (every rank agrees: with a
        vocabulary-parallel head the logits are a collective), and those: (batch row, flat row of
        the prompt's last token). An embedding request has no draft tokens."""
        pooling, rows = self.input_batch.pooling, model_input.sampled_rows
        if not pooling or not any(row in pooling for row in rows):
            return model_input, []
        first_logits = first_logits_rows(model_input.drafts)
        flat = model_input.logits_indices.tolist()
        keep = [i for i, row in enumerate(rows) if row not in pooling]
        kept_logits = [first_logits[i] + j for i in keep for j in range(len(model_input.drafts[i]) + 1)]
        rest = dataclasses.replace(
            model_input,
            logits_indices=model_input.logits_indices[kept_logits],
            sampled_rows=[rows[i] for i in keep],
            drafts=[model_input.drafts[i] for i in keep],
        )
        return rest, [(row, flat[first_logits[i]]) for i, row in enumerate(rows) if row in pooling]

    def _pool(self, hidden: torch.Tensor, pooled: list[tuple[int, int]], output: ModelRunnerOutput) -> None:
        """Each embedding request's output: its prompt's last hidden state, normed as the LM head
        would see it, pooled by its PoolingParams; a scoring request's: from that row's logits."""
        batch = self.input_batch
        normed, _ = self.model.norm(hidden[[flat for _, flat in pooled]])
        scored = self._scored_logits(hidden, pooled)
        for (row, _), vector in zip(pooled, normed, strict=True):
            params = batch.pooling[row]
            with _failing_alone(output, batch.req_ids[row]):
                pooled_value = params.score(scored[row]) if row in scored else params.pool(vector)
                output.pooled[batch.req_ids[row]] = pooled_value

    def _scored_logits(self, hidden: torch.Tensor, pooled: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """The logits of the scoring requests' last rows, by batch row (every rank computes them:
        with a vocabulary-parallel head they are a collective; rank 0 alone gets them)."""
        scoring = [(row, flat) for row, flat in pooled if self.input_batch.pooling[row].score_tokens]
        if not scoring:
            return {}
        logits = self.model.compute_logits(hidden[[flat for _, flat in scoring]])
        return {} if logits is None else {row: logits[i] for i, (row, _) in enumerate(scoring)}

    def _verify(
        self,
        logits: torch.Tensor,
        first_logits: list[int],
        model_input: ModelInput,
        output: ModelRunnerOutput,
    ) -> None:
        """The requests with draft tokens, checked by spec_decode (their accepted tokens and one
        more) all at once, or each alone where that raises."""
        assert self.spec_decode is not None  # drafts are scheduled only with speculation on
        batch, spec_decode = self.input_batch, self.spec_decode

        def check(group: list[int]) -> None:
            args = (first_logits, model_input.sampled_rows, model_input.drafts, group)
            rows, tokens, logprobs = spec_decode.verify(batch, logits, *args)
            self._record(output, tokens, logprobs, rows)

        checked = [i for i, draft in enumerate(model_input.drafts) if draft]
        try:
            check(checked)
            return
        except Exception:
            logger.warning("Batched draft checking failed; checking the %d requests one by one", len(checked))
        for i in checked:
            with _failing_alone(output, batch.req_ids[model_input.sampled_rows[i]]):
                check([i])

    def _logits_for_rank_0(
        self, hidden: torch.Tensor, model_input: ModelInput, pooled: list[tuple[int, int]]
    ) -> None:
        """Tensor-parallel ranks but 0, with a vocabulary-parallel head: their share of every
        logits rank 0 computes this step, in the same order (scoring requests, prompt scoring,
        then sampling)."""
        if not self.model.lm_head.vocab_parallel:
            return
        self._scored_logits(hidden, pooled)
        for _, first_row, num_rows in model_input.prompt_scoring:
            self.model.compute_logits(hidden[first_row : first_row + num_rows])
        if model_input.sampled_rows:
            self.model.compute_logits(hidden[model_input.logits_indices])

    def _sample(self, logits: torch.Tensor, rows: list[int], output: ModelRunnerOutput) -> None:
        """Sample the batch at once; if that raises, each request alone, so only the ones at
        fault fail. logits: [len(rows), vocab]."""
        batch = self.input_batch
        try:
            tokens, logprobs = self.sampler(logits, batch.sampling_metadata(rows))
        except Exception:
            logger.warning("Batched sampling failed; sampling the %d requests one by one", len(rows))
            for i, row in enumerate(rows):
                with _failing_alone(output, batch.req_ids[row]):
                    alone = batch.sampling_metadata([row])
                    token, logprob = self.sampler(logits[i : i + 1], alone)
                    self._record(output, [token], [logprob], [row])
            return
        self._record(output, [[token] for token in tokens], [[lp] for lp in logprobs], rows)

    def _record(
        self,
        output: ModelRunnerOutput,
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprobs | None]],
        rows: list[int],
    ) -> None:
        """Each row's new tokens and, per token, its logprobs (None where not asked for)."""
        batch = self.input_batch
        for row, new_tokens, lps in zip(rows, tokens, logprobs, strict=True):
            req_id = batch.req_ids[row]
            output.sampled_token_ids[req_id] = new_tokens
            if lps and lps[0] is not None:
                output.logprobs[req_id] = [lp for lp in lps if lp is not None]
        batch.append_tokens(rows, tokens)  # the runner's copy grows as the scheduler's

    def _score_prompt(self, hidden: torch.Tensor, row: int, first: int, num_rows: int) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens that follow this chunk's rows (teacher forcing)."""
        # logits first: with a vocabulary-parallel head they are a gather every rank joins
        logits = self.model.compute_logits(hidden[first : first + num_rows])
        batch = self.input_batch
        start = int(batch.num_computed_tokens[row]) + 1
        targets = torch.from_numpy(batch.token_ids[row, start : start + num_rows])
        targets = targets.to(hidden.device, torch.long)
        assert logits is not None
        k = batch.num_prompt_logprobs[row]
        return gather_logprobs(torch.log_softmax(logits, dim=-1), targets, [k] * num_rows)  # type: ignore[return-value]


@contextlib.contextmanager
def _failing_alone(output: ModelRunnerOutput, req_id: str) -> Iterator[None]:
    """One request's own work: an error in it fails that request (logged), not the step."""
    try:
        yield
    except Exception as error:
        logger.exception("Request %s failed; the others go on", req_id)
        output.failed[req_id] = f"{type(error).__name__}: {error}"
