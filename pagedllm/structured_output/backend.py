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

from pagedllm import limits
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

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows no alternative to from here (xgrammar's jump-forward
        tokens: no stop token, and not a last one that a longer token could extend); the
        matcher stays where it is."""
        return self._matcher.find_jump_forward_tokens()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (draft tokens: the rest
        cannot be accepted). The matcher is left where it was."""
        accepted = 0
        for token_id in tokens:
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        """Rows row .. row + len(draft): the tokens allowed here, then after each draft token in
        turn (the positions a speculative step samples at); the matcher is left where it was.
        The draft must be one the grammar allows (valid_prefix). After a stop token the rows
        allow everything: the request ends there, and what is sampled after it is dropped."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        accepted = 0
        try:
            for token_id in draft:
                if not self._matcher.accept_token(token_id):
                    raise ValueError(f"draft token {token_id} does not follow the grammar")
                accepted += 1
                if self._matcher.is_terminated():
                    bitmask[row + accepted : row + len(draft) + 1] = -1
                    break
                self._matcher.fill_next_token_bitmask(bitmask, row + accepted)
        finally:
            if accepted:
                self._matcher.rollback(accepted)

    @property
    def is_terminated(self) -> bool:
        """The output is complete (the grammar's end, or a stop token after it)."""
        return self._matcher.is_terminated()


class StructuredOutputBackend:
    """Compiles grammars for one tokenizer and vocabulary, and keeps them for reuse. Thread-safe.
    The offline API compiles here, in-process; the server compiles in worker processes
    (GrammarCompilePool) and `put`s the result, so the engine thread only finds it cached. The
    vocabulary index that xgrammar needs (~1 s for 50k tokens) is built at the first structured
    request, not at start-up."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._tokenizer_info: xgrammar.TokenizerInfo | None = None  # with the compiler
        self._cache: OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached). ValueError naming the field for an invalid grammar."""
        compiled = self.cached(params)
        if compiled is None:
            compiled = compile_grammar(self._get_compiler(), grammar_key(params), self.vocab_size)
            self.put(params, compiled)
        return compiled

    def cached(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar | None:
        key = grammar_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def put(self, params: StructuredOutputsParams, compiled: xgrammar.CompiledGrammar) -> None:
        """Cache a grammar compiled elsewhere (or refresh one): the next `compile` finds it."""
        key = grammar_key(params)
        with self._lock:
            previous = self._cache.pop(key, None)
            if previous is not None:
                self._cached_bytes -= previous.memory_size_bytes
            self._cache[key] = compiled
            self._cached_bytes += compiled.memory_size_bytes
            while len(self._cache) > 1 and (
                len(self._cache) > MAX_CACHED_GRAMMARS or self._cached_bytes > limits.MAX_CACHED_GRAMMAR_BYTES
            ):
                self._cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes

    def tokenizer_info_json(self) -> str:
        """The vocabulary index, as a compile process needs it (and as it must deserialize against)."""
        self._get_compiler()
        assert self._tokenizer_info is not None
        return self._tokenizer_info.serialize_json()

    def deserialize(self, compiled_json: str) -> xgrammar.CompiledGrammar:
        """A grammar a compile process serialized."""
        import xgrammar

        self._get_compiler()
        assert self._tokenizer_info is not None  # set with the compiler
        return xgrammar.CompiledGrammar.deserialize_json(compiled_json, self._tokenizer_info)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                start = time.monotonic()
                self._tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(
                    self._tokenizer_info, max_threads=1, cache_enabled=False
                )
                logger.info("Structured output: xgrammar ready in %.1f s", time.monotonic() - start)
            return self._compiler


GrammarKey = tuple[str, str, bool]
"""(kind, spec, disable_any_whitespace): what a compiled grammar depends on; plain data, so it
crosses to a compile process as JSON."""


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    return (params.kind, params.spec, params.disable_any_whitespace)


def compile_grammar(
    compiler: xgrammar.GrammarCompiler, key: GrammarKey, vocab_size: int
) -> xgrammar.CompiledGrammar:
    """Compile and vet one grammar. ValueError naming the field if it is invalid, too large, or
    allows no first token of this vocabulary."""
    kind = key[0]
    start = time.monotonic()
    try:
        compiled = _compile(compiler, key)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"structured_outputs.{kind}: {_first_line(error)}") from None
    if compiled.memory_size_bytes > limits.MAX_COMPILED_GRAMMAR_BYTES:
        raise ValueError(
            f"structured_outputs.{kind}: compiles to {compiled.memory_size_bytes / 2**20:.0f} MiB, over the "
            f"limit of {limits.MAX_COMPILED_GRAMMAR_BYTES / 2**20:.0f} MiB; simplify it"
        )
    if not _can_start(compiled, vocab_size):
        raise ValueError(
            f"structured_outputs.{kind}: no token of this model's vocabulary can begin "
            "an output this grammar allows"
        )
    logger.debug("Compiled a %s grammar in %.0f ms", kind, (time.monotonic() - start) * 1e3)
    return compiled


def _compile(compiler: xgrammar.GrammarCompiler, key: GrammarKey) -> xgrammar.CompiledGrammar:
    kind, spec, disable_any_whitespace = key
    any_whitespace = not disable_any_whitespace
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec))
        return compiler.compile_grammar(f"root ::= {alternatives}")
    return compiler.compile_grammar(spec)


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
