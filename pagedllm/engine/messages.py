"""What crosses between a front end (LLMEngine, AsyncLLM) and the EngineCore, all plain values
(vLLM V1 keeps its EngineCoreRequest in `v1/engine/__init__.py` for the same reason): both sides
import these, neither imports the other's module for them. Were the core to run in a process of its
own, these are what its transport would carry (docs/architecture.md, "Front ends and the core").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.kv_cache import KVCachePlan

if TYPE_CHECKING:
    import xgrammar


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request the InputProcessor has validated: what `EngineCore.add_request` trusts as is.
    It crosses from a front end to the core: plain values, and a compiled grammar."""

    req_id: str
    prompt_token_ids: list[int]
    """Tokenized and truncated; every id within the vocabulary, fewer than max_model_len of them."""
    sampling_params: SamplingParams
    max_tokens: int
    """Resolved: sampling_params.max_tokens, or what max_model_len leaves after the prompt."""
    arrival_time: float
    prompt: str | None = None
    cache_salt: str | None = None
    user: str | None = None
    lora_request: LoRARequest | None = None
    """The adapter it runs under, checked by the front end (None: the base model)."""
    grammar: xgrammar.CompiledGrammar | None = None
    """Compiled from sampling_params.structured_outputs (set when that is, before add_request)."""
    eos_token_ids: frozenset[int] = frozenset()
    """Tokens that end the request unless ignore_eos: the model's and its tokenizer's end of
    sequence, which only the front end knows (the core has no tokenizer)."""


@dataclass(frozen=True)
class ModelFacts:
    """What a front end needs to know of the model and its cache, fixed once the core has
    started: the core returns it once (`EngineCore.facts`), and a front end reads nothing else
    of the core's at start-up."""

    model_name: str
    """The display name, e.g. SmolLM2-135M-Instruct."""
    model_config: ModelConfig
    max_model_len: int
    """Resolved: --max-model-len, or the model's own."""
    dtype: str
    """The activations' dtype, e.g. bfloat16."""
    device: str
    """cpu or cuda."""
    tp_size: int
    kv_cache_plan: KVCachePlan
    """Rank 0's: with tensor parallelism, every rank holds the same blocks of its heads."""

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_plan.num_blocks
