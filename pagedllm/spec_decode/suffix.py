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

Memory: a plain trie holds a node per (place, depth), up to max_depth nodes a token, each a
Python dict and ints. The tries here are path-compressed as ArcticInference's: a node is a run of
tokens along which the count does not change, stored as a reference (sequence, start, length)
into the token arrays, so a chain that one place alone reached is one node, split where a second
place reaches into it. A count changes only where the trie branches or where a suffix ends (at
max_depth, or at a sequence's end), so there are at most ~2 nodes a token, kept in flat int
arrays, with a children dict only on nodes that have children. Indexing does less work than the
plain trie's (the chains of single places, most of its nodes, are never made) and drafting the
same. Considered instead: a suffix array per request, but drafting then counts continuations at
every step (slow where a token recurs often) and it does not serve the shared trie's eviction;
and flat arrays for the plain trie, still max_depth nodes a token.

The shared trie also keeps at most max_cached_tokens tokens of outputs (MAX_CACHED_TOKENS unless
told): the oldest finished outputs go first while it holds more, so its memory is bounded however
long the outputs; running requests' outputs are not evicted.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MAX_CACHED_TOKENS = 1 << 18
"""The shared trie's cap in output tokens, besides max_cached_requests: at most two nodes and a
token each, a small share beside the KV cache of as many tokens."""

_ROOT = 0


class _Trie:
    """Every substring of at most max_depth tokens of the sequences added, counted once per place
    it occurs. Each place's suffix is indexed up to max_depth tokens (or its sequence's end), so
    a count is how often the substring occurs in the sequences.

    Nodes are ids into flat int arrays (which the garbage collector does not walk). Node n spans
    the tokens `tokens[seqs[n]][starts[n] : starts[n] + lengths[n]]`, one place where its whole
    path from the root occurs, all of them occurring `counts[n]` times. Invariants:
    - a suffix being extended (the last 1, 2, ... tokens of a running sequence) ends at the end
      of a node, as does every suffix indexed (so a count changes only at a node's end);
    - a node's reference is a place in a sequence still held (a live one, or a copy of its
      path made when its sequence was removed), so the tokens it spans are its own;
    - children of node n are keyed by their first token, in the order the plain trie created
      them (ties between children go to the earlier, as the plain trie's dict did)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: list[dict[int, int] | None] = [{}]
        """node -> {first token: child node}, None for a leaf; node 0 is the root."""
        self.counts = array("i", [0])
        self.lengths = array("i", [0])
        self.seqs = array("i", [0])
        self.starts = array("i", [0])
        self.parents = array("i", [0])
        self.free: list[int] = []
        """Ids of removed nodes, to reuse."""
        self.tokens: dict[int, array[int]] = {}
        """Sequence id -> its tokens: the sequences added and not removed, and copies of paths
        that outlived their sequence (`copies`)."""
        self.copies: set[int] = set()
        self.num_refs: dict[int, int] = {}
        """Sequence id -> the nodes referencing it (a copy is dropped at 0)."""
        self.num_tokens = 0
        """Tokens of the sequences added and not removed."""
        self._next_seq = 0

    def add_sequence(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self.tokens[seq] = array("i")
        return seq

    def append(self, seq: int, ends: list[int], token: int) -> list[int]:
        """Count the substrings `token` ends in sequence `seq`, whose last 1, 2, ... tokens end
        at the nodes `ends` (at most max_depth - 1 of them). Returns the sequence's ends after it."""
        tokens = self.tokens[seq]
        tokens.append(token)
        self.num_tokens += 1
        place = len(tokens) - 1
        counts, lengths, seqs = self.counts, self.lengths, self.seqs
        grown = []
        for node in [_ROOT, *ends][: self.max_depth]:
            if node != _ROOT and counts[node] == 1:
                # Only this place reached node, a leaf: its run grows (most calls, inlined).
                lengths[node] += 1
                if seqs[node] != seq:  # it referenced a copy of its path
                    self._point(node, seq, place + 1 - lengths[node])
                grown.append(node)
            else:
                grown.append(self._extend(seq, place, node, token))
        return grown[: max(self.max_depth - 1, 0)]

    def _extend(self, seq: int, place: int, node: int, token: int) -> int:
        """The suffix ending at node's end goes on with `token` (at `place` in seq): the node
        where it ends now. Node is the root or was reached by another place too."""
        counts, lengths, starts = self.counts, self.lengths, self.starts
        kids = self.children[node]
        child = kids.get(token) if kids else None
        if child is None:
            child = self._new_node(node, seq, place, 1, 1)
            if kids is None:
                self.children[node] = {token: child}
            else:
                kids[token] = child
            return child
        assert kids is not None
        if node != _ROOT and counts[node] == counts[child] + 1:
            # Every other place that reached node goes on with `token` (into its only child):
            # node's run grows by one token, taken from the child.
            if lengths[child] == 1:  # the child absorbs node
                parent = self.parents[node]
                starts[child] -= lengths[node]
                lengths[child] += lengths[node]
                counts[child] += 1
                self.parents[child] = parent
                parent_kids = self.children[parent]
                assert parent_kids is not None
                parent_kids[self._first_token(child)] = child
                self._free_node(node)
                return child
            lengths[node] += 1
            if self.seqs[node] in self.copies:  # other references are places that go on too
                self._point(node, seq, place + 1 - lengths[node])
            del kids[token]
            starts[child] += 1
            lengths[child] -= 1
            kids[self.tokens[self.seqs[child]][starts[child]]] = child
            return node
        if lengths[child] == 1:
            counts[child] += 1
            return child
        # The suffix ends inside the child's run: split it after its first token.
        middle = self._new_node(node, seq, place, 1, counts[child] + 1)
        kids[token] = middle  # the same key keeps the children's order
        starts[child] += 1
        lengths[child] -= 1
        self.parents[child] = middle
        self.children[middle] = {self.tokens[self.seqs[child]][starts[child]]: child}
        return middle

    def remove(self, seq: int) -> None:
        """Uncount a sequence added before, all of it, and drop it."""
        tokens = self.tokens[seq]
        visited: list[tuple[int, int]] = []
        """Nodes the sequence's suffixes went through, with the depth of their end."""
        ends: list[int] = []
        for start in range(len(tokens)):
            node, depth = _ROOT, 0
            limit = min(self.max_depth, len(tokens) - start)
            while depth < limit:
                kids = self.children[node]
                assert kids is not None
                token = tokens[start + depth]
                child = kids[token]
                self.counts[child] -= 1
                if self.counts[child] == 0:  # its subtree counted only this place
                    del kids[token]
                    self._free_subtree(child)
                    break
                depth += self.lengths[child]
                visited.append((child, depth))
                node = child
            else:
                ends.append(node)
        for node in ends:  # where a suffix ended, the count may no longer change
            kids = self.children[node]
            if self.counts[node] and kids is not None and len(kids) == 1:
                child = next(iter(kids.values()))
                if self.counts[child] == self.counts[node]:
                    self._merge_into_child(node, child)
        # Nodes still referencing the sequence take another place: a child's, or a copy.
        visited.sort(key=lambda item: -item[1])
        for node, depth in visited:
            if self.counts[node] == 0 or self.seqs[node] != seq:
                continue
            other = next((c for c in (self.children[node] or {}).values() if self.seqs[c] != seq), None)
            if other is not None:
                self._point(node, self.seqs[other], self.starts[other] - self.lengths[node])
            else:
                end = self.starts[node] + self.lengths[node]
                copy = self.add_sequence()
                self.tokens[copy] = tokens[end - depth : end]
                self.copies.add(copy)
                self._point(node, copy, depth - self.lengths[node])
        assert not self.num_refs.get(seq)
        self.num_refs.pop(seq, None)
        del self.tokens[seq]
        self.num_tokens -= len(tokens)

    def find(self, tail: list[int]) -> tuple[int, int] | None:
        """Where `tail` ends (node, tokens into its run), if it occurs."""
        node, offset = _ROOT, 0
        for token in tail:
            if offset == self.lengths[node]:
                kids = self.children[node]
                child = kids.get(token) if kids else None
                if child is None:
                    return None
                node, offset = child, 1
            elif self.tokens[self.seqs[node]][self.starts[node] + offset] == token:
                offset += 1
            else:
                return None
        return node, offset

    def match(self, tail: list[int], known: list[int]) -> list[tuple[int, int]]:
        """Where tail's last 1, 2, ... tokens end, as far as they occur, given the nodes where
        the first of them end (`known`)."""
        chain = [(node, self.lengths[node]) for node in known]
        for length in range(len(known) + 1, len(tail) + 1):
            found = self.find(tail[len(tail) - length :])
            if found is None:
                break
            chain.append(found)
        return chain

    def draft(self, node: int, offset: int, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent path on from `offset` tokens into node's run, up to `limit` tokens,
        stopping at a token whose share of the continuations is below min_token_prob; with its
        expected accepted length (the sum over its tokens of the product of the shares so far)."""
        counts = self.counts
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            if offset < self.lengths[node]:  # inside a run: the only continuation, share 1
                if min_token_prob > 1.0:
                    break
                draft.append(self.tokens[self.seqs[node]][self.starts[node] + offset])
                offset += 1
                score += prob
                continue
            kids = self.children[node]
            if not kids:
                break
            best_token = max(kids, key=lambda token: counts[kids[token]])
            best = kids[best_token]
            share = counts[best] / sum(counts[child] for child in kids.values())
            if share < min_token_prob:
                break
            prob *= share
            score += prob
            draft.append(best_token)
            node, offset = best, 1
        return draft, score

    def num_nodes(self) -> int:
        return len(self.counts) - len(self.free)

    def _first_token(self, node: int) -> int:
        return self.tokens[self.seqs[node]][self.starts[node]]

    def _new_node(self, parent: int, seq: int, start: int, length: int, count: int) -> int:
        self.num_refs[seq] = self.num_refs.get(seq, 0) + 1
        if self.free:
            node = self.free.pop()
            self.parents[node], self.seqs[node], self.starts[node] = parent, seq, start
            self.lengths[node], self.counts[node] = length, count
            return node
        self.children.append(None)
        self.parents.append(parent)
        self.seqs.append(seq)
        self.starts.append(start)
        self.lengths.append(length)
        self.counts.append(count)
        return len(self.counts) - 1

    def _point(self, node: int, seq: int, start: int) -> None:
        """Reference another place of node's path."""
        old = self.seqs[node]
        if old != seq:
            self._unref(old)
            self.num_refs[seq] = self.num_refs.get(seq, 0) + 1
            self.seqs[node] = seq
        self.starts[node] = start

    def _unref(self, seq: int) -> None:
        self.num_refs[seq] -= 1
        if self.num_refs[seq] == 0 and seq in self.copies:
            del self.num_refs[seq], self.tokens[seq]
            self.copies.discard(seq)

    def _free_node(self, node: int) -> None:
        self._unref(self.seqs[node])
        self.children[node] = None
        self.counts[node] = 0
        self.free.append(node)

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend((self.children[node] or {}).values())
            self._free_node(node)

    def _merge_into_child(self, node: int, child: int) -> None:
        parent = self.parents[node]
        parent_kids = self.children[parent]
        assert parent_kids is not None
        self.starts[child] -= self.lengths[node]
        self.lengths[child] += self.lengths[node]
        self.parents[child] = parent
        parent_kids[self._first_token(child)] = child  # the same key keeps the children's order
        self._free_node(node)


@dataclass
class _Request:
    trie: _Trie
    """Its prompt and output (sequence 0)."""
    num_prompt_tokens: int
    num_indexed: int = 0
    ends: list[int] = field(default_factory=list)
    """Where its context's last 1, 2, ... tokens end in its own trie."""
    output_seq: int | None = None
    """Its output's sequence in the shared trie."""
    output_ends: list[int] = field(default_factory=list)
    """Where its output's last 1, 2, ... tokens end in the shared trie."""


class SuffixProposer:
    def __init__(
        self,
        max_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
        max_cached_tokens: int = MAX_CACHED_TOKENS,
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.shared = _Trie(max_depth) if max_cached_requests > 0 else None
        """The outputs of the running requests and of the last finished ones (at most
        max_cached_requests of them, and while they hold at most max_cached_tokens)."""
        self.finished: deque[int] = deque()
        """The finished outputs' sequences in the shared trie, oldest first."""
        self.requests: dict[str, _Request] = {}

    def propose(self, req_id: str, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens to follow `token_ids` (a request's prompt and output so far);
        indexes only what was appended since the last call."""
        request = self.requests.get(req_id)
        if request is None:
            # The runner first asks right after the request's first sampled token: what comes
            # before it is the prompt, which only the request's own trie keeps.
            trie = _Trie(self.max_depth)
            trie.add_sequence()
            request = self.requests[req_id] = _Request(trie, len(token_ids) - 1)
            if self.shared is not None:
                request.output_seq = self.shared.add_sequence()
        self._index(request, token_ids)
        trie = request.trie
        chain = [(node, trie.lengths[node]) for node in request.ends]
        draft, score = self._best_draft(trie, chain, max_tokens)
        if self.shared is not None:
            tail = token_ids[max(len(token_ids) - self.max_depth + 1, 0) :].tolist()
            shared_chain = self.shared.match(tail, request.output_ends)
            shared_draft, shared_score = self._best_draft(self.shared, shared_chain, max_tokens)
            if shared_score > score:
                draft = shared_draft
        return draft

    def finish(self, req_id: str) -> None:
        """Drop the request's own trie; its output stays in the shared one, the oldest finished
        outputs going while more than max_cached_requests, or more than max_cached_tokens
        tokens, are kept."""
        request = self.requests.pop(req_id, None)
        if request is None or self.shared is None or request.output_seq is None:
            return
        self.finished.append(request.output_seq)
        while self.finished and (
            len(self.finished) > self.max_cached_requests or self.shared.num_tokens > self.max_cached_tokens
        ):
            self.shared.remove(self.finished.popleft())

    def _index(self, request: _Request, token_ids: np.ndarray) -> None:
        trie, shared, output_seq = request.trie, self.shared, request.output_seq
        for position, token in enumerate(token_ids[request.num_indexed :].tolist(), request.num_indexed):
            request.ends = trie.append(0, request.ends, token)
            if shared is not None and output_seq is not None and position >= request.num_prompt_tokens:
                request.output_ends = shared.append(output_seq, request.output_ends, token)
        request.num_indexed = len(token_ids)

    def _best_draft(
        self, trie: _Trie, chain: list[tuple[int, int]], max_tokens: int
    ) -> tuple[list[int], float]:
        """The draft with the highest expected accepted length from any matched suffix (`chain`,
        where the last 1, 2, ... tokens end). Every length is tried, not just the longest: a match
        of length k leaves room for only max_depth - k tokens below it, and a longer match may be
        less sure."""
        best: list[int] = []
        best_score = 0.0
        for length in range(len(chain), 0, -1):  # longest first: a tie keeps the surer match
            # (the epsilon keeps 0.1 * 30 at 3)
            limit = min(max_tokens, math.ceil(self.max_spec_factor * length - 1e-9))
            if limit <= best_score:  # a draft's score is at most its length
                continue
            node, offset = chain[length - 1]
            draft, score = trie.draft(node, offset, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best, best_score
