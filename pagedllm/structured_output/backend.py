"""Grammars compiled by xgrammar for this model's vocabulary, and each request's matcher."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next, and whether it is done."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The output is complete (the grammar's end, or a stop token after it)."""
        return self._matcher.is_terminated()


class StructuredOutputBackend:
    """Compiles grammars for one tokenizer and vocabulary. Thread-safe: the server compiles on its
    own thread, the engine thread only finds the result in the cache. The vocabulary index that
    xgrammar needs (~1 s for 50k tokens) is built at the first structured request, not at start-up."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str, bool], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached). ValueError naming the field for an invalid grammar."""
        key = (params.kind, params.spec, params.disable_any_whitespace)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiler = self._get_compiler()
        start = time.monotonic()
        try:
            compiled = _compile(compiler, params)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(error)}") from None
        if not _can_start(compiled, self.vocab_size):
            raise ValueError(
                f"structured_outputs.{params.kind}: no token of this model's vocabulary can begin "
                "an output this grammar allows"
            )
        logger.debug("Compiled a %s grammar in %.0f ms", params.kind, (time.monotonic() - start) * 1e3)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self.compile(params))

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                start = time.monotonic()
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
                logger.info("Structured output: xgrammar ready in %.1f s", time.monotonic() - start)
            return self._compiler


def _compile(compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    any_whitespace = not params.disable_any_whitespace
    if params.kind == "json":
        return compiler.compile_json_schema(params.spec, any_whitespace=any_whitespace, strict_mode=True)
    if params.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if params.kind == "regex":
        return compiler.compile_regex(params.spec)
    if params.kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice or [])
        return compiler.compile_grammar(f"root ::= {alternatives}")
    return compiler.compile_grammar(params.spec)


def _can_start(compiled: xgrammar.CompiledGrammar, vocab_size: int) -> bool:
    """Whether some token may come first: a grammar whose strings no token sequence of this
    vocabulary can begin would mask every logit of the request's first step."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:500]
