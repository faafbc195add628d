"""The suffix proposer alone, no model: drafts from a request's own context and from earlier
outputs, the limits on a draft, eviction from the shared trie, and incremental indexing counted
exactly as from scratch. (Greedy equality with speculation on: test_equivalence.py.)"""

from __future__ import annotations

import time
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


def _counts(trie: _Trie, node: int = 0, path: tuple[int, ...] = ()) -> Counter[tuple[int, ...]]:
    """What the trie counts, substring by substring."""
    counts: Counter[tuple[int, ...]] = Counter()
    for token, child in trie.children[node].items():
        counts[(*path, token)] = trie.counts[child]
        counts.update(_counts(trie, child, (*path, token)))
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
    ends: list[int] = []
    for token in [1, 2, 1, 2]:
        ends = trie.append(ends, token)
    num_nodes = len(trie.counts)
    trie.remove([1, 2, 1, 2])
    assert not trie.children[0] and len(trie.free) == num_nodes - 1
    ends = []
    for token in [1, 2, 1, 2]:
        ends = trie.append(ends, token)
    assert len(trie.counts) == num_nodes and not trie.free


def test_per_step_time_with_a_long_context():
    """Not asserted (shared hosts): printed, run with -s to read it."""
    rng = np.random.default_rng(0)
    text = rng.integers(0, 2000, size=5000, dtype=np.int32)
    text[2000:2500] = text[500:1000]  # some repetition to draft from
    proposer = _proposer()
    start = time.perf_counter()
    proposer.propose("r", text[:4000], 4)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for end in range(4001, 5001):
        proposer.propose("r", text[:end], 4)
    per_step = (time.perf_counter() - start) / 1000
    print(f"\nsuffix proposer: 4,000-token context {first * 1e3:.0f} ms, then {per_step * 1e6:.0f} us a step")
