"""Suffix decoding (vLLM's and Snowflake ArcticInference's `suffix` method): drafts from tries that
count every short substring of the request's own context and of the outputs of earlier requests.

Where ngram copies whatever followed the latest earlier match, the counts here say how sure a
continuation is: a draft runs long where the text has repeated itself the same way and stops
where it branched, and an output seen before (an agent re-running the same tool call, the same
question asked twice) is drafted before this request has said it once.

    context  x a b c a b d a b | ?     suffixes that occur: "b", "a b", "d a b" (< max_depth)
    trie     root -a-> "a" (3) -b-> "a b" (3) +-c-> "a b c" (1) -a-> ...
                                              +-d-> "a b d" (1) -a-> ...
    draft    after "a b": c or d, each 1 of the 2 continuations (share 1/2); with
             min_token_prob <= 1/2 the draft is "c a ...", expected accepted 1/2 + 1/2 * 1 + ...

From each suffix that occurs, the draft follows the most frequent child while its share of the
continuations is >= min_token_prob (a greedy path; ArcticInference's stop is on the product of
the shares instead); of these drafts, the one with the highest expected accepted length wins.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np


class _Trie:
    """Every substring of at most max_depth tokens of the sequences added, counted once per place
    it occurs. A sequence of n tokens adds at most n * max_depth nodes; since every substring of a
    counted string is counted too, the suffixes of a context that occur are those up to a length.

    Nodes are ids into flat lists, their children dicts of plain ints, which the garbage
    collector does not track: as objects, the tens of thousands of nodes of a long context were
    walked by every full collection, and indexing and drafting ran about 10x slower."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: list[dict[int, int]] = [{}]
        """node -> {token: child node}; node 0 is the root, the empty string."""
        self.counts: list[int] = [0]
        """node -> the places its substring occurs."""
        self.free: list[int] = []
        """Ids of removed nodes, to reuse."""

    def append(self, ends: list[int], token: int) -> list[int]:
        """Count the substrings `token` ends, in a sequence whose last 1, 2, ... tokens are the
        nodes `ends` (at most max_depth - 1 of them). Returns the sequence's ends after it."""
        children, counts = self.children, self.counts
        grown = []
        for node in [0, *ends][: self.max_depth]:
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = self._new_node()
            counts[child] += 1
            grown.append(child)
        return grown[: max(self.max_depth - 1, 0)]

    def remove(self, token_ids: list[int]) -> None:
        """Uncount a sequence appended before, all of it."""
        for start in range(len(token_ids)):
            node = 0
            for token in token_ids[start : start + self.max_depth]:
                child = self.children[node][token]
                self.counts[child] -= 1
                if self.counts[child] == 0:  # its subtree counted only this place
                    del self.children[node][token]
                    self._free_subtree(child)
                    break
                node = child

    def match(self, tail: list[int], known: list[int]) -> list[int]:
        """The nodes of tail's last 1, 2, ... tokens, as far as they occur, given the first of
        them (`known`)."""
        chain = list(known)
        for length in range(len(known) + 1, len(tail) + 1):
            node = 0
            for token in tail[len(tail) - length :]:
                child = self.children[node].get(token)
                if child is None:
                    return chain
                node = child
            chain.append(node)
        return chain

    def draft(self, node: int, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, up to `limit` tokens, stopping at a token whose
        share of its parent's continuations is below min_token_prob; with its expected accepted
        length (the sum over its tokens of the product of the shares so far)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit and self.children[node]:
            kids = self.children[node]
            best_token = max(kids, key=lambda token: self.counts[kids[token]])
            best = kids[best_token]
            share = self.counts[best] / sum(self.counts[child] for child in kids.values())
            if share < min_token_prob:
                break
            prob *= share
            score += prob
            draft.append(best_token)
            node = best
        return draft, score

    def _new_node(self) -> int:
        if self.free:
            return self.free.pop()
        self.children.append({})
        self.counts.append(0)
        return len(self.counts) - 1

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node] = {}
            self.counts[node] = 0
            self.free.append(node)


@dataclass
class _Request:
    trie: _Trie
    """Its prompt and output."""
    num_prompt_tokens: int
    num_indexed: int = 0
    ends: list[int] = field(default_factory=list)
    """Its context's last 1, 2, ... tokens in its own trie."""
    output_ends: list[int] = field(default_factory=list)
    """Its output's last 1, 2, ... tokens in the shared trie."""
    output: list[int] = field(default_factory=list)
    """What it added to the shared trie, to take out again on eviction."""


class SuffixProposer:
    def __init__(
        self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.shared = _Trie(max_depth) if max_cached_requests > 0 else None
        """The outputs of the running requests and of the last max_cached_requests finished."""
        self.finished: deque[list[int]] = deque()
        self.requests: dict[str, _Request] = {}

    def propose(self, req_id: str, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens to follow `token_ids` (a request's prompt and output so far);
        indexes only what was appended since the last call."""
        request = self.requests.get(req_id)
        if request is None:
            # The runner first asks right after the request's first sampled token: what comes
            # before it is the prompt, which only the request's own trie keeps.
            request = self.requests[req_id] = _Request(_Trie(self.max_depth), len(token_ids) - 1)
        self._index(request, token_ids)
        draft, score = self._best_draft(request.trie, request.ends, max_tokens)
        if self.shared is not None:
            tail = token_ids[max(len(token_ids) - self.max_depth + 1, 0) :].tolist()
            chain = self.shared.match(tail, request.output_ends)
            shared_draft, shared_score = self._best_draft(self.shared, chain, max_tokens)
            if shared_score > score:
                draft = shared_draft
        return draft

    def finish(self, req_id: str) -> None:
        """Drop the request's own trie; its output stays in the shared one, the oldest finished
        request's going once more than max_cached_requests are kept."""
        request = self.requests.pop(req_id, None)
        if request is None or self.shared is None:
            return
        self.finished.append(request.output)
        while len(self.finished) > self.max_cached_requests:
            self.shared.remove(self.finished.popleft())

    def _index(self, request: _Request, token_ids: np.ndarray) -> None:
        for position, token in enumerate(token_ids[request.num_indexed :].tolist(), request.num_indexed):
            request.ends = request.trie.append(request.ends, token)
            if self.shared is not None and position >= request.num_prompt_tokens:
                request.output_ends = self.shared.append(request.output_ends, token)
                request.output.append(token)
        request.num_indexed = len(token_ids)

    def _best_draft(self, trie: _Trie, chain: list[int], max_tokens: int) -> tuple[list[int], float]:
        """The draft with the highest expected accepted length from any matched suffix (`chain`,
        shortest first). Every length is tried, not just the longest: a match of length k leaves
        room for only max_depth - k tokens below it, and a longer match may be less sure."""
        best: list[int] = []
        best_score = 0.0
        for length in range(len(chain), 0, -1):  # longest first: a tie keeps the surer match
            # (the epsilon keeps 0.1 * 30 at 3)
            limit = min(max_tokens, math.ceil(self.max_spec_factor * length - 1e-9))
            if limit <= best_score:  # a draft's score is at most its length
                continue
            draft, score = trie.draft(chain[length - 1], limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best, best_score
