"""InputProcessor: the one front door. A prompt and its SamplingParams become an EngineRequest,
checked, truncated and tokenized once, before the engine thread sees them (vLLM V1's
`Processor.process_inputs`).

    prompt, params --InputProcessor.process--> EngineRequest --EngineCore.add_request--> Request
    (event loop or the offline caller's thread)                 (engine thread: bookkeeping only)

The processor reads only what is fixed at start-up (max_model_len, the vocabulary size,
--max-logprobs, the tokenizer), so any thread may call it. Each front end owns one: AsyncLLM
calls its own on the event loop, LLMEngine from `add_request`. Its grammar backend is
thread-safe and touched by no step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm import limits
from pagedllm.engine.messages import EngineRequest, ModelFacts
from pagedllm.lora.checker import LoRAChecker
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend import StructuredOutputBackend

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase


PromptType = str | list[int] | dict


class InputProcessor:
    """Validates, truncates and tokenizes requests against fixed model limits. Thread-safe."""

    def __init__(
        self,
        *,
        max_model_len: int,
        vocab_size: int,
        max_logprobs: int,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Iterable[int],
        lora_checker: LoRAChecker | None = None,
    ) -> None:
        """`lora_checker`: the adapters' check with --enable-lora (None: requests name none)."""
        self.lora_checker = lora_checker
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.structured_output = StructuredOutputBackend(tokenizer, vocab_size, self.eos_token_ids)
        """Compiles grammars for this vocabulary (thread-safe; the server's compile pool feeds it)."""

    @classmethod
    def for_model(
        cls,
        facts: ModelFacts,
        tokenizer: PreTrainedTokenizerBase,
        max_logprobs: int,
        lora_checker: LoRAChecker | None = None,
    ) -> InputProcessor:
        """A front end's own processor: the core's facts, and the front end's tokenizer, whose
        end-of-sequence id joins the model's (generation_config's, e.g. Llama 3's <|eot_id|>)."""
        eos = [*facts.model_config.eos_token_ids]
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        return cls(
            max_model_len=facts.max_model_len,
            vocab_size=facts.vocab_size,
            max_logprobs=max_logprobs,
            tokenizer=tokenizer,
            eos_token_ids=eos,
            lora_checker=lora_checker,
        )

    def process(
        self,
        req_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        user: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """Tokenize a text prompt, truncate it (truncate_prompt_tokens) and check the request
        against the model's limits. The grammar is left to `compile_grammar` (or the server's
        compile pool). Raises ValueError naming the first field at fault, checked in this order:
        prompt, prompt_token_ids, lengths, logprobs, prompt_logprobs, stop_token_ids, logit_bias,
        cache_salt, user, lora_request."""
        prompt_text, prompt_ids = self._tokenize(prompt)
        prompt_ids = self.truncated(prompt_ids, params)
        self._check_token_ids("prompt_token_ids", prompt_ids)
        max_tokens = self._check_lengths(prompt_ids, params)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}: {value} is over the limit of {self.max_logprobs} (--max-logprobs)")
        self._check_token_ids("stop_token_ids", params.stop_token_ids or [], allow_empty=True)
        self._check_token_ids("logit_bias", list(params.logit_bias or {}), allow_empty=True)
        if params.pooling is not None and params.pooling.score_tokens is not None:
            self._check_token_ids("score_tokens", list(params.pooling.score_tokens))
        limits.check_text("cache_salt", cache_salt, limits.MAX_CACHE_SALT_CHARS)
        limits.check_text("user", user, limits.MAX_USER_CHARS)
        if lora_request is not None:
            if self.lora_checker is None:
                raise ValueError("lora_request: this engine serves no adapters (start it with --enable-lora)")
            lora_request = self.lora_checker.check(lora_request)
        return EngineRequest(
            req_id=req_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            arrival_time=arrival_time or time.monotonic(),
            prompt=prompt_text,
            cache_salt=cache_salt,
            user=user,
            lora_request=lora_request,
            eos_token_ids=self.eos_token_ids,
        )

    def compile_grammar(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar, in this thread (cached). ValueError naming the field if invalid."""
        return self.structured_output.compile(params)

    def truncated(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens, or all of it. -1 (vLLM's "as many as
        max_model_len allows") keeps what leaves room for max_tokens, or for one token without it:
        a prompt of max_model_len tokens could generate nothing."""
        keep = params.truncate_prompt_tokens
        if keep is None or not isinstance(prompt_ids, list):
            return prompt_ids
        if keep == -1:  # never below one token: a max_tokens this large gets its own 400
            keep = max(1, self.max_model_len - (params.max_tokens or 1))
        return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), prompt["prompt_token_ids"]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: the prompt is empty")
            limits.check_text("prompt", prompt)
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, list):
            return None, prompt
        raise ValueError(f"prompt: expected a string, token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, name: str, token_ids: object, allow_empty: bool = False) -> None:
        if not isinstance(token_ids, list) or not (token_ids or allow_empty):
            raise ValueError(f"{name}: must be a non-empty list of token ids")
        vocab = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"{name}: every token id must be an integer in [0, {vocab})")

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens after checking it fits max_model_len."""
        num_prompt = len(prompt_ids)
        if not num_prompt:
            raise ValueError("prompt: the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: {num_prompt:,} tokens leave no room to generate within max_model_len "
                f"{self.max_model_len:,}; shorten the prompt or raise --max-model-len"
            )
        if params.max_tokens is None:
            return self.max_model_len - num_prompt
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({num_prompt:,} tokens) + max_tokens ({params.max_tokens:,}) = "
                f"{num_prompt + params.max_tokens:,} is over max_model_len {self.max_model_len:,}; "
                "lower max_tokens or shorten the prompt"
            )
        return params.max_tokens
