"""The suffix proposer alone, no model: drafts from a request's own context and from earlier
outputs, the limits on a draft, eviction from the shared trie, and incremental indexing counted
exactly as from scratch. (Greedy equality with speculation on: test_equivalence.py.)"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode.suffix import SuffixProposer, _Trie

PHRASE = [10, 11, 12, 13, 14, 15, 16, 17]


def _proposer(
    max_depth: int = 24, max_cached_requests: int = 10, factor: float = 1.0, min_prob: float = 0.1
) -> SuffixProposer:
    return SuffixProposer(max_depth, max_cached_requests, factor, min_prob)


def _run(proposer: SuffixProposer, req_id: str, prompt: list[int], output: list[int], max_tokens: int = 4):
    """As the runner asks: once per sampled token, with the prompt and the output so far.
    Returns the last draft."""
    draft: list[int] = []
    for end in range(1, len(output) + 1):
        draft = proposer.propose(req_id, np.array(prompt + output[:end], dtype=np.int32), max_tokens)
    return draft


def _counts(trie: _Trie) -> Counter[tuple[int, ...]]:
    """What the trie counts, substring by substring: each node's run spelled out from the tokens
    it references, one substring per token of the run, all with the node's count. Also checks
    the bookkeeping of references: every node alive is its parent's child under its first token,
    references count right, and only referenced copies are held."""
    counts: Counter[tuple[int, ...]] = Counter()
    num_refs: Counter[int] = Counter()
    stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (trie.children[node] or {}).items():
            assert trie.parents[child] == node and trie.counts[child] > 0
            num_refs[trie.seqs[child]] += 1
            start, length = trie.starts[child], trie.lengths[child]
            run = tuple(trie.tokens[trie.seqs[child]][start : start + length])
            assert len(run) == length and run[0] == token
            # the reference is a place of the whole path
            assert start >= len(path)
            assert tuple(trie.tokens[trie.seqs[child]][start - len(path) : start]) == path
            for end in range(1, length + 1):
                counts[(*path, *run[:end])] = trie.counts[child]
            stack.append((child, (*path, *run)))
    assert num_refs == Counter({seq: n for seq, n in trie.num_refs.items() if n})
    assert all(num_refs[seq] for seq in trie.copies)
    return counts


def _substrings(sequences: list[list[int]], max_depth: int) -> Counter[tuple[int, ...]]:
    """Every substring of at most max_depth tokens, once per place it occurs: what a trie counts."""
    return Counter(
        tuple(seq[start:end])
        for seq in sequences
        for start in range(len(seq))
        for end in range(start + 1, min(start + max_depth, len(seq)) + 1)
    )


def test_a_repeated_phrase_is_drafted_from_the_requests_own_context():
    proposer = _proposer()
    assert _run(proposer, "a", [*PHRASE, 50, 51], [52, 10, 11, 12, 13]) == [14, 15, 16, 17]
    assert _run(proposer, "b", [1, 2, 3], [4, 5]) == []  # nothing repeats yet


def test_an_earlier_requests_output_is_drafted_for_a_new_request():
    proposer = _proposer()
    _run(proposer, "a", [100, 101], PHRASE)
    proposer.finish("a")
    assert "a" not in proposer.requests  # its own trie is gone, its output stays shared
    assert _run(proposer, "b", [5, 6, 10, 11, 12], [13]) == [14, 15, 16, 17]
    # the prompt alone is not shared: a request quoting a's prompt gets nothing
    assert _run(proposer, "c", [7, 100], [101]) == []


def test_max_tokens_the_spec_factor_and_the_depth_bound_a_draft():
    context = ([*PHRASE, 50, 51], [52, 10, 11, 12, 13])  # the last 4 tokens match the phrase
    assert _run(_proposer(), "a", *context, max_tokens=2) == [14, 15]
    assert _run(_proposer(), "a", *context, max_tokens=8) == [14, 15, 16, 17]  # factor 1: 4 matched
    assert _run(_proposer(factor=0.5), "a", *context, max_tokens=8) == [14, 15]
    assert _run(_proposer(factor=2.0), "a", *context, max_tokens=8) == [14, 15, 16, 17, 50, 51, 52, 10]
    # depth 6: below a 4-token match only 2 tokens are indexed, below a 3-token match 3
    assert _run(_proposer(max_depth=6), "a", *context, max_tokens=8) == [14, 15, 16]


def test_min_token_prob_cuts_a_branchy_continuation():
    # after "1 2 3" came 4 once and 6 once: each a share of 1/2
    context = ([1, 2, 3, 4, 5, 8, 1, 2, 3, 6, 7, 9], [1, 2])
    assert _run(_proposer(factor=4.0, min_prob=0.6), "a", *context) == [3]
    assert _run(_proposer(factor=4.0, min_prob=0.4), "a", *context, max_tokens=3) == [3, 4, 5]


def test_eviction_takes_out_the_oldest_finished_output_exactly():
    proposer = _proposer(max_cached_requests=1)
    _run(proposer, "a", [100, 101], PHRASE)
    proposer.finish("a")
    assert _run(proposer, "b", [5, 6, 10, 11, 12], [13]) == [14, 15, 16, 17]
    proposer.finish("b")  # two finished, one kept: a's output goes
    assert _run(proposer, "c", [7, 10, 11, 12], [13]) == []
    assert proposer.shared is not None
    assert _counts(proposer.shared) == _substrings([[13], [13]], 24)  # b's and c's outputs
    proposer.finish("c")
    assert _counts(proposer.shared) == _substrings([[13]], 24)
    assert not proposer.requests


def test_without_cached_requests_nothing_is_shared():
    proposer = _proposer(max_cached_requests=0)
    _run(proposer, "a", [100, 101], PHRASE)
    proposer.finish("a")
    assert proposer.shared is None
    assert _run(proposer, "b", [5, 6, 10, 11, 12], [13]) == []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=2, max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=8),
    max_depth=st.integers(1, 7),
    min_prob=st.sampled_from([0.0, 0.3, 0.6]),
    factor=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_incremental_indexing_counts_and_drafts_as_from_scratch(tokens, cuts, max_depth, min_prob, factor):
    """Fed step by step or all at once after the first call, the same tries and the same draft;
    and the tries count exactly the substrings of the context (own) and of the output (shared)."""
    num_prompt = len(tokens) // 2
    first = np.array(tokens[: num_prompt + 1], dtype=np.int32)
    stepped, at_once = (_proposer(max_depth, 4, factor, min_prob) for _ in range(2))
    for proposer in (stepped, at_once):
        proposer.propose("r", first, 4)
    for end in sorted(cut for cut in cuts if num_prompt + 1 < cut < len(tokens)):
        stepped.propose("r", np.array(tokens[:end], dtype=np.int32), 4)
    context = np.array(tokens, dtype=np.int32)
    assert stepped.propose("r", context, 4) == at_once.propose("r", context, 4)
    for proposer in (stepped, at_once):
        assert _counts(proposer.requests["r"].trie) == _substrings([tokens], max_depth)
        assert proposer.shared is not None
        assert _counts(proposer.shared) == _substrings([tokens[num_prompt:]], max_depth)


@given(outputs=st.lists(st.lists(st.integers(0, 3), max_size=20), max_size=6), keep=st.integers(1, 3))
def test_the_shared_trie_counts_exactly_the_kept_outputs(outputs, keep):
    proposer = _proposer(max_depth=5, max_cached_requests=keep)
    for i, output in enumerate(outputs):
        _run(proposer, str(i), [9], output)
        proposer.finish(str(i))
    assert proposer.shared is not None
    assert _counts(proposer.shared) == _substrings([o for o in outputs if o][-keep:], 5)


def test_a_trie_frees_nodes_whose_count_reaches_zero_and_reuses_them():
    trie = _Trie(3)
    seq = trie.add_sequence()
    ends: list[int] = []
    for token in [1, 2, 1, 2]:
        ends = trie.append(seq, ends, token)
    num_nodes = trie.num_nodes()
    assert num_nodes == 5  # root, "1 2" (2), its leaf "1" (1), "2" (2), its leaf "1 2" (1)
    trie.remove(seq)
    assert not trie.children[0] and trie.num_nodes() == 1 and not trie.tokens and not trie.num_tokens
    seq = trie.add_sequence()
    ends = []
    for token in [1, 2, 1, 2]:
        ends = trie.append(seq, ends, token)
    assert trie.num_nodes() == num_nodes and not trie.free


def test_a_node_outliving_its_sequence_references_a_copy_of_its_path():
    trie = _Trie(2)
    first, second = trie.add_sequence(), trie.add_sequence()
    first_ends: list[int] = []
    for token in [5, 6]:
        first_ends = trie.append(first, first_ends, token)
    second_ends: list[int] = []
    for token in [5, 6]:  # the leaf "5 6" ends both, first references it
        second_ends = trie.append(second, second_ends, token)
    trie.remove(first)
    assert _counts(trie) == _substrings([[5, 6]], 2)
    # the leaves "5 6" and "6" end only second's suffixes now, which are not below them
    assert first not in trie.tokens and sorted(len(trie.tokens[seq]) for seq in trie.copies) == [1, 2]
    trie.remove(second)
    assert not trie.tokens and not trie.copies and trie.num_nodes() == 1


class _PlainProposer:
    """The proposer over plain tries (a node per substring, children created in order): the
    definition the path-compressed tries must draft exactly as."""

    def __init__(self, max_depth: int, max_cached_requests: int, factor: float, min_prob: float) -> None:
        self.max_depth, self.keep = max_depth, max_cached_requests
        self.factor, self.min_prob = factor, min_prob
        self.shared: list[dict[int, int]] = [{}]
        self.counts = [0]
        self.requests: dict[str, tuple[list[dict[int, int]], list[int], list[int]]] = {}
        self.finished: list[list[int]] = []

    def _add(self, trie: list[dict[int, int]], counts: list[int], tokens: list[int]) -> None:
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start : start + self.max_depth]:
                if token not in trie[node]:
                    trie[node][token] = len(trie)
                    trie.append({})
                    counts.append(0)
                node = trie[node][token]
                counts[node] += 1

    def _remove(self, tokens: list[int]) -> None:
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start : start + self.max_depth]:
                child = self.shared[node][token]
                self.counts[child] -= 1
                if self.counts[child] == 0:
                    del self.shared[node][token]
                    break
                node = child

    def _draft(self, trie: list[dict[int, int]], counts: list[int], context: list[int], max_tokens: int):
        best: list[int] = []
        best_score = 0.0
        matched = [
            k for k in range(1, min(self.max_depth, len(context) + 1)) if self._find(trie, context[-k:])
        ]
        for length in reversed(matched):
            limit = min(max_tokens, math.ceil(self.factor * length - 1e-9))
            if limit <= best_score:
                continue
            node = self._find(trie, context[-length:])
            assert node is not None
            draft: list[int] = []
            prob, score = 1.0, 0.0
            while len(draft) < limit and trie[node]:
                kids = trie[node]
                token = max(kids, key=lambda t: counts[kids[t]])
                share = counts[kids[token]] / sum(counts[c] for c in kids.values())
                if share < self.min_prob:
                    break
                prob *= share
                score += prob
                draft.append(token)
                node = kids[token]
            if score > best_score:
                best, best_score = draft, score
        return best, best_score

    @staticmethod
    def _find(trie: list[dict[int, int]], tail: list[int]) -> int | None:
        node: int | None = 0
        for token in tail:
            node = trie[node].get(token) if node is not None else None
        return node

    def propose(self, req_id: str, context: list[int], num_prompt: int, max_tokens: int) -> list[int]:
        if req_id not in self.requests:
            self.requests[req_id] = ([{}], [0], [])
        trie, counts, output = self.requests[req_id]
        trie.clear(), counts.clear()
        trie.append({}), counts.append(0)
        self._add(trie, counts, context)  # from scratch: the same children order as growing it
        new_output = context[num_prompt + len(output) :]
        # the shared trie grows token by token, as the runner feeds it
        for end in range(len(output) + 1, len(output) + len(new_output) + 1):
            grown = output + new_output[: end - len(output)]
            self._add_last(grown)
        output.extend(new_output)
        draft, score = self._draft(trie, counts, context, max_tokens)
        shared_draft, shared_score = self._draft(self.shared, self.counts, context, max_tokens)
        return shared_draft if shared_score > score else draft

    def _add_last(self, output: list[int]) -> None:
        """Count the substrings the output's last token ends."""
        for start in range(max(len(output) - self.max_depth, 0), len(output)):
            node = 0
            for token in output[start:]:
                if token not in self.shared[node]:
                    self.shared[node][token] = len(self.shared)
                    self.shared.append({})
                    self.counts.append(0)
                node = self.shared[node][token]
            self.counts[node] += 1

    def finish(self, req_id: str) -> None:
        self.finished.append(self.requests.pop(req_id)[2])
        while len(self.finished) > self.keep:
            self._remove(self.finished.pop(0))


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=6), st.booleans()),
        max_size=25,
    ),
    max_depth=st.integers(1, 6),
    keep=st.integers(1, 3),
    min_prob=st.sampled_from([0.0, 0.3, 0.6]),
    factor=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_drafts_are_the_plain_tries_drafts(steps, max_depth, keep, min_prob, factor):
    """Requests interleaved, finished and evicted: every draft is the one the plain tries give
    (the same counts and the same tie order), and the shared trie counts the kept outputs."""
    proposer = _proposer(max_depth, keep, factor, min_prob)
    plain = _PlainProposer(max_depth, keep, factor, min_prob)
    contexts: dict[str, tuple[list[int], int]] = {}
    running: dict[str, list[int]] = {}
    kept: list[list[int]] = []
    for slot, tokens, finish in steps:
        req_id = str(slot)
        if req_id not in contexts:
            contexts[req_id] = (tokens, len(tokens) - 1)  # first call: prompt and one token
        else:
            contexts[req_id] = (contexts[req_id][0] + tokens, contexts[req_id][1])
        context, num_prompt = contexts[req_id]
        running[req_id] = context[num_prompt:]
        expected = plain.propose(req_id, context, num_prompt, 4)
        assert proposer.propose(req_id, np.array(context, dtype=np.int32), 4) == expected
        if finish:
            proposer.finish(req_id)
            plain.finish(req_id)
            kept = [*kept, running.pop(req_id)][-keep:]
            del contexts[req_id]  # the slot starts a new request next
    assert proposer.shared is not None
    assert _counts(proposer.shared) == _substrings([*kept, *running.values()], max_depth)


def test_the_shared_trie_keeps_at_most_max_cached_tokens_of_finished_outputs():
    proposer = SuffixProposer(24, 10, 1.0, 0.1, max_cached_tokens=10)
    for i in range(4):
        _run(proposer, str(i), [100], [i] * 4)
        proposer.finish(str(i))
    assert proposer.shared is not None
    assert proposer.shared.num_tokens == 8 and len(proposer.finished) == 2
    assert _counts(proposer.shared) == _substrings([[2] * 4, [3] * 4], 24)
    _run(proposer, "long", [100], [7] * 12)  # a running output stays, over the cap
    assert proposer.shared.num_tokens == 20
    proposer.finish("long")  # finished, it goes too: it alone is over the cap
    assert proposer.shared.num_tokens == 0 and not proposer.finished and not proposer.shared.tokens
