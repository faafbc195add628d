"""Request: one prompt's journey through the engine, as bookkeeping (no tensors).

Token regions of a request at any step:

    |<-------------- num_tokens = len(all_token_ids) ---------------->|
    | prompt_token_ids                    | output_token_ids          |
    |<--- num_computed_tokens --->|<- num_scheduled (this step) ->|   |

Everything left of `num_computed_tokens` has its K/V in the cache. Chunked prefill,
prefix-cache hits and preemption (which resets it to 0) are all moves of that one count.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.backend import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """This request failed (e.g. in its sampling or detokenization); the others went on."""

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's words: stop | length, and vLLM's abort | error; None while unfinished."""
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    """Tokens that end the request unless `ignore_eos` (the tokenizer's EOS and the model's
    generation-config EOS ids, e.g. Llama 3's <|eot_id|>)."""
    max_tokens: int
    """Resolved limit: sampling_params.max_tokens, or what max_model_len leaves."""
    prompt: str | None = None
    cache_salt: str | None = None
    user: str | None = None
    """Caller's name (the OpenAI `user` field), for per-caller cache statistics."""
    lora_request: LoRARequest | None = None
    """The adapter it runs under (None: the base model)."""
    arrival_time: float = field(default_factory=time.monotonic)
    grammar: RequestGrammar | None = None
    """Where the output stands in its grammar (structured output requests only)."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache at first scheduling (None until then)."""
    num_preemptions: int = 0
    num_prompt_logprobs: int = 0
    """Prompt positions already scored and reported (prompt_logprobs requests)."""
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    """Draft tokens checked for this request, and of them accepted (per-response timings; the
    drafts themselves and the acceptance record are the DraftPolicy's, core/draft_policy.py)."""
    num_accepted_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of the request's full blocks, in order; grown as tokens are appended."""
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def take_new_prompt_logprobs(self, entries: list | None) -> list:
        """The entries of a step's prompt logprobs not reported before (a preempted request scores
        its prompt again). Called before the step's tokens count as computed."""
        if not entries:
            return []
        new = entries[max(0, self.num_prompt_logprobs - self.num_computed_tokens) :]
        self.num_prompt_logprobs += len(new)
        return new

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
