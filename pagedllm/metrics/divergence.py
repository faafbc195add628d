"""Why prompts that should share a prefix do not: the divergence finder.

A system prompt that embeds the time, a request id or a user's name a few hundred tokens in makes
every request's blocks after that point hash differently, and the prefix cache misses from there
on without any error. The finder names such places:

    observe(prompt)   at admission, on the engine thread: the prompt's longest shared run of full
                      blocks with an earlier prompt (its chained block hashes, looked up in an
                      index), then its blocks join the index. O(blocks), no diff.
    report()          on demand (GET /stats, `pagedllm analyze prefix`): for each prompt observed
                      since, the token range where it stopped sharing with the closest earlier
                      prompt and where the two agree again (first common run of RESYNC_TOKENS);
                      prompts that differ at the same block after the same shared prefix form
                      one group.

Only a divergence followed by agreement is reported: prompts that share a system prompt and then
differ to the end (the user's question) are what prefix caching expects, not a fault. Memory is
bounded by `max_tokens` (4 bytes per kept prompt token, plus an index entry per full block;
older prompts go first). The reported text is the operator's data: the server shows it only
behind --api-key, and --no-divergence-text keeps offsets and counts alone.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

RESYNC_TOKENS = 8
"""Tokens in a row that must agree for two prompts to count as sharing again."""
DIFF_WINDOW = 2048
"""Tokens after the divergence searched for the point where the prompts agree again."""
CONTEXT_TOKENS = 8
"""Tokens of context shown either side of a differing span."""
MIN_BLOCKS_AGAIN = 2
"""A divergence counts when the prompts then agree for this many blocks: moving the variable part
would share at least a block more (shorter common runs are phrases, not a shared template)."""
HEAD_TOKENS = 4
"""Prompts that differ inside their first block are matched by their first tokens."""
MAX_VARIANTS = 3
MAX_GROUPS = 256
DEFAULT_MAX_TOKENS = 1_000_000


@dataclass
class _Prompt:
    tokens: array
    block_hashes: list[bytes]
    shared_blocks: int
    """Leading full blocks it shares with the closest earlier prompt (at observe time)."""
    sibling: int | None
    """That prompt's id (or one sharing later blocks at the same place, when none is shared)."""


@dataclass
class Divergence:
    """One prompt's departure from its closest earlier prompt."""

    start: int
    """First token that differs (tokens before it are shared)."""
    end: int
    """First token of the common run after the differing span (this prompt's offset)."""
    sibling_end: int
    shared_after: int
    """Tokens that agree again from `end` on (within DIFF_WINDOW)."""


@dataclass
class DivergenceGroup:
    block: int
    """Block index where the prompts of this group stop sharing."""
    requests: int = 0
    first_token: int = 0
    last_token: int = 0
    """Token range [first_token, last_token) that differs across the group."""
    shared_after_tokens: int = 0
    """Sum over the group of tokens that agree again after the span: what moving it would share."""
    variants: list[str] = field(default_factory=list)
    """A few distinct texts of the differing span, with context ("…before[span]after…")."""

    def as_dict(self, with_text: bool, block_size: int) -> dict:
        entry = {
            "requests": self.requests,
            "shared_tokens": self.first_token,
            "block": self.block,
            "differs_at_tokens": [self.first_token, self.last_token],
            "shares_again_tokens": self.shared_after_tokens // max(self.requests, 1),
            "recoverable_tokens": self.shared_after_tokens // block_size * block_size,
        }
        if with_text:
            entry["variants"] = self.variants
        return entry

    def sentence(self) -> str:
        variants = " vs ".join(repr(v) for v in self.variants[:2])
        return (
            f"{self.requests} requests share {self.first_token} tokens, then differ at token "
            f"{self.first_token}..{self.last_token}{f' ({variants})' if variants else ''}, then share "
            f"{self.shared_after_tokens // max(self.requests, 1)} tokens again: move the variable part "
            "to the end of the prompt"
        )


class DivergenceFinder:
    def __init__(
        self,
        block_size: int,
        decode: Callable[[Sequence[int]], str] | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.block_size = block_size
        self.decode = decode
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()
        self._by_prefix: dict[bytes, int] = {}  # chained block hash -> newest prompt holding it
        self._by_content: dict[tuple[int, int], int] = {}  # (block index, its tokens' hash) -> prompt
        self._by_head: dict[bytes, int] = {}  # first HEAD_TOKENS tokens -> newest prompt
        self._num_tokens = 0
        self._next_id = 0
        self._pending: list[int] = []
        self._groups: dict[tuple[bytes, int], DivergenceGroup] = {}
        self._lock = threading.Lock()

    def observe(self, prompt_token_ids: Sequence[int], block_hashes: Sequence[bytes]) -> int | None:
        """Index one admitted prompt (its full blocks' chained hashes, in order); its id, or None
        for a prompt shorter than a block."""
        num_blocks = min(len(block_hashes), len(prompt_token_ids) // self.block_size)
        if num_blocks == 0:
            return None
        hashes = list(block_hashes[:num_blocks])
        tokens = array("i", prompt_token_ids)
        with self._lock:
            shared = 0
            while shared < num_blocks and hashes[shared] in self._by_prefix:
                shared += 1
            sibling = self._by_prefix[hashes[shared - 1]] if shared else self._sibling_without_blocks(tokens)
            prompt_id = self._next_id
            self._next_id += 1
            self._prompts[prompt_id] = _Prompt(tokens, hashes, shared, sibling)
            self._num_tokens += len(tokens)
            for index, block_hash in enumerate(hashes):
                self._by_prefix[block_hash] = prompt_id
                self._by_content[(index, self._content_key(tokens, index))] = prompt_id
            self._by_head[_head(tokens)] = prompt_id
            if shared < num_blocks and sibling is not None:
                self._pending.append(prompt_id)
            while self._num_tokens > self.max_tokens and len(self._prompts) > 1:
                self._evict()
        return prompt_id

    def report(self, top: int = 10) -> list[DivergenceGroup]:
        """The divergence groups so far (new prompts analysed first), most recoverable first."""
        self.analyse()
        with self._lock:
            groups = sorted(self._groups.values(), key=lambda g: -g.shared_after_tokens)
        return groups[:top]

    def analyse(self) -> dict[int, Divergence]:
        """Diff each prompt observed since the last call with its closest earlier prompt (off the
        lock: the engine thread keeps observing); {prompt id: divergence} of those that agree again."""
        with self._lock:
            pending, self._pending = self._pending, []
            pairs = [
                (p, self._prompts[p], self._prompts.get(self._prompts[p].sibling))  # type: ignore[arg-type]
                for p in pending
                if p in self._prompts
            ]
        found: dict[int, tuple[_Prompt, Divergence]] = {}
        for prompt_id, prompt, sibling in pairs:
            div = divergence(prompt.tokens, sibling.tokens) if sibling is not None else None
            if div is not None and div.shared_after >= MIN_BLOCKS_AGAIN * self.block_size:
                found[prompt_id] = (prompt, div)
        with self._lock:
            for prompt, div in found.values():
                self._add(prompt, div)
        return {prompt_id: div for prompt_id, (_, div) in found.items()}

    def _add(self, prompt: _Prompt, div: Divergence) -> None:
        block = div.start // self.block_size
        parent = prompt.block_hashes[block - 1] if block else b""
        group = self._groups.get((parent, block))
        if group is None:
            if len(self._groups) >= MAX_GROUPS:  # the group that would recover least goes
                del self._groups[min(self._groups, key=lambda k: self._groups[k].shared_after_tokens)]
            group = DivergenceGroup(block, first_token=div.start, last_token=div.end)
            self._groups[(parent, block)] = group
        group.requests += 1
        group.first_token = min(group.first_token, div.start)
        group.last_token = max(group.last_token, div.end)
        group.shared_after_tokens += div.shared_after
        if self.decode is not None and len(group.variants) < MAX_VARIANTS:
            text = self._variant_text(prompt.tokens, div)
            if text not in group.variants:
                group.variants.append(text)

    def _variant_text(self, tokens: array, div: Divergence) -> str:
        assert self.decode is not None
        before = self.decode(tokens[max(0, div.start - CONTEXT_TOKENS) : div.start])
        span = self.decode(tokens[div.start : div.end])
        after = self.decode(tokens[div.end : div.end + CONTEXT_TOKENS])
        return f"…{before}[{span}]{after}…"

    def _sibling_without_blocks(self, tokens: array) -> int | None:
        """The prompts differ inside the first block, so no chained hash is shared: an earlier
        prompt that starts with the same tokens, else one with the same tokens in a later block
        at the same place (the variable part is at the very start)."""
        sibling = self._by_head.get(_head(tokens))
        if sibling is not None:
            return sibling
        for index in range(1, len(tokens) // self.block_size):
            sibling = self._by_content.get((index, self._content_key(tokens, index)))
            if sibling is not None:
                return sibling
        return None

    def _content_key(self, tokens: array, index: int) -> int:
        return hash(tokens[index * self.block_size : (index + 1) * self.block_size].tobytes())

    def _evict(self) -> None:
        prompt_id, prompt = self._prompts.popitem(last=False)
        self._num_tokens -= len(prompt.tokens)
        for index, block_hash in enumerate(prompt.block_hashes):
            if self._by_prefix.get(block_hash) == prompt_id:
                del self._by_prefix[block_hash]
            key = (index, self._content_key(prompt.tokens, index))
            if self._by_content.get(key) == prompt_id:
                del self._by_content[key]
        if self._by_head.get(_head(prompt.tokens)) == prompt_id:
            del self._by_head[_head(prompt.tokens)]

    @property
    def num_prompts(self) -> int:
        return len(self._prompts)


def _head(tokens: array) -> bytes:
    return tokens[:HEAD_TOKENS].tobytes()


def divergence(a: Sequence[int], b: Sequence[int]) -> Divergence | None:
    """Where `a` departs from `b` and where they agree again (the first RESYNC_TOKENS-long common
    run after the departure, at any shift within DIFF_WINDOW); None if they never depart or never
    agree again."""
    start = _common_prefix(a, b)
    if start == min(len(a), len(b)):
        return None
    b_runs: dict[bytes, int] = {}
    b_window = array("i", b[start : start + DIFF_WINDOW])
    for offset in range(len(b_window) - RESYNC_TOKENS + 1):
        b_runs.setdefault(b_window[offset : offset + RESYNC_TOKENS].tobytes(), offset)
    a_window = array("i", a[start : start + DIFF_WINDOW])
    for offset in range(len(a_window) - RESYNC_TOKENS + 1):
        b_offset = b_runs.get(a_window[offset : offset + RESYNC_TOKENS].tobytes())
        if b_offset is not None:  # never (0, 0): a[start] != b[start]
            end, sibling_end = start + offset, start + b_offset
            shared = _common_prefix(a[end:], b[sibling_end:])
            return Divergence(start, end, sibling_end, shared)
    return None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))
