"""The sampler against hand-computed references on small logits, and seeds end to end."""

from __future__ import annotations

import math

import torch

from pagedllm import SamplingParams
from pagedllm.core.outputs import NewRequestData, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, apply_penalties, candidates, whole_vocabulary_probs
from pagedllm.worker.input_batch import InputBatch


def request(req_id="r", prompt=(1, 2), output=(), eos=frozenset({0}), **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        sampling_params=SamplingParams(**params),
        eos_token_ids=eos,
        block_ids=[],
        num_computed_tokens=len(prompt) + len(output) - 1,
    )


def metadata(reqs: list[NewRequestData], vocab_size: int) -> SamplingMetadata:
    """What the runner's input batch gives the sampler for these requests, in this order."""
    batch = InputBatch(len(reqs), 16, 1, vocab_size, torch.device("cpu"))
    batch.update(SchedulerOutput(new_requests=reqs))
    return batch.sampling_metadata([batch.row_of[req.req_id] for req in reqs])


def sample(logits, reqs, seed=0):
    return Sampler(torch.device("cpu"), seed)(logits, metadata(reqs, logits.shape[1]))


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 4.9]])
    tokens, _ = sample(logits, [request(temperature=0), request("s", temperature=0)])
    assert tokens == [1, 0]


def test_top_k_1_and_tiny_top_p_and_full_min_p_are_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    reqs = [
        request("a", temperature=1.0, top_k=1),
        request("b", temperature=1.0, top_p=1e-6),
        request("c", temperature=1.0, min_p=1.0),
    ]
    for seed in range(5):
        tokens, _ = sample(logits, reqs, seed)
        assert tokens == logits.argmax(-1).tolist()


def test_top_k_samples_only_among_the_k_best():
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0, 3.7]])
    seen = set()
    for seed in range(30):
        tokens, _ = sample(logits, [request(temperature=2.0, top_k=2)], seed)
        seen.add(tokens[0])
    assert seen == {0, 1}  # both of the two best are drawn, nothing else


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = set()
    for seed in range(200):
        tokens, _ = sample(logits, [request(temperature=1.0, top_p=0.8)], seed)
        seen.add(tokens[0])
    assert seen == {0, 1}  # 0.5 < 0.8, 0.5 + 0.3 reaches it


CUTS = [
    {"top_k": k, "top_p": p, "min_p": m} for k in (None, 5, 300) for p in (1.0, 0.5, 0.9) for m in (0.0, 0.05)
]


def test_the_tokens_that_may_be_drawn_are_those_transformers_warpers_keep():
    """top-k, then top-p on the distribution top-k left, then min-p: transformers' warpers in that
    order are the reference, row by row, in one batch of every combination, a seeded row among
    them. A top-p row without a top-k is cut among its 256 most likely tokens where the row is
    peaked, 4,096 where it is less so, and all of them where it is near flat: each kind here."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    vocab = 8000
    logits = torch.cat([torch.randn(len(CUTS), vocab, generator=gen) * spread for spread in (4, 1, 0.05)])
    settings = CUTS * 3
    reqs = [request(f"r{i}", temperature=0.7, **cut) for i, cut in enumerate(settings)]
    for row in (3, 2 * len(CUTS) + 3):  # a peaked and a flat row, each cut alone
        reqs[row] = request(f"seeded{row}", temperature=0.7, seed=5, **settings[row])
    probs = whole_vocabulary_probs(candidates(logits, metadata(reqs, vocab)), logits)
    for row, cut in enumerate(settings):
        scores = logits[row : row + 1] / 0.7
        if cut["top_k"] is not None:
            scores = TopKLogitsWarper(cut["top_k"])(None, scores)
        if cut["top_p"] < 1:
            scores = TopPLogitsWarper(cut["top_p"])(None, scores)
        if cut["min_p"] > 0:
            scores = MinPLogitsWarper(cut["min_p"])(None, scores)
        expected = torch.softmax(scores, dim=-1)[0]
        assert torch.equal(probs[row] > 0, expected > 0), (row, cut)
        torch.testing.assert_close(probs[row], expected, rtol=1e-4, atol=1e-7)


def test_a_zero_uniform_draw_still_picks_the_only_likely_token(monkeypatch):
    """The race's noise is -log(U); torch.rand returns U = 0 about once in 2^24. A row whose one
    token has all the mass (a grammar or a low temperature leaves one) must still draw it then,
    cut or not."""
    logits = torch.full((2, 50), float("-inf"))
    logits[:, 7] = 0.0
    monkeypatch.setattr(torch, "rand", lambda shape, generator=None, device=None: torch.zeros(shape))
    tokens, _ = sample(logits, [request("whole", temperature=1.0), request("cut", temperature=1.0, top_k=5)])
    assert tokens == [7, 7]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    reqs = [request(f"r{i}", temperature=1.0) for i in range(4000)]
    tokens, _ = sample(logits, reqs, seed=3)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_request_is_independent_of_its_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    alone, _ = sample(logits[2:3], [request("x", temperature=1.0, seed=42)], seed=1)
    batch = [
        request("a", temperature=1.0),
        request("b", temperature=0.7, seed=7),
        request("x", temperature=1.0, seed=42),
        request("d", temperature=0),
    ]
    together, _ = sample(logits, batch, seed=99)
    assert together[2] == alone[0]
    for cut in CUTS:  # cut, and beside rows that cut otherwise
        alone, _ = sample(logits[2:3], [request("x", temperature=1.0, seed=42, **cut)], seed=1)
        batch[2] = request("x", temperature=1.0, seed=42, **cut)
        batch[0] = request("a", temperature=1.0, top_k=3)
        together, _ = sample(logits, batch, seed=99)
        assert together[2] == alone[0], cut


def test_penalties_match_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    req = request(
        prompt=(3,), output=(0, 0, 1), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    penalties = metadata([req], logits.shape[1]).penalties
    assert penalties is not None
    out = apply_penalties(logits, penalties)[0].tolist()
    # token 0: seen, positive -> /2, then -0.5*2 (freq) -0.25 (presence)
    # token 1: seen, negative -> *2, then -0.5*1 -0.25; token 2: unseen; token 3: in prompt -> /2
    assert out == [2.0 / 2 - 1.0 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 1.0 / 2]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    tokens, _ = sample(logits, [request(output=(), temperature=0, min_tokens=2, stop_token_ids=[2])])
    assert tokens == [1]
    tokens, _ = sample(logits, [request(output=(1, 1), temperature=0, min_tokens=2)])
    assert tokens == [0]


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    _, logprobs = sample(logits, [request(temperature=0, logprobs=2, repetition_penalty=1.5)])
    expected = torch.log_softmax(logits, -1)[0]
    entry = logprobs[0]
    assert entry.token_ids == [1, 1, 2]
    assert entry.ranks == [1, 1, 2]
    for token_id, lp in zip(entry.token_ids, entry.logprobs, strict=True):
        assert math.isclose(lp, float(expected[token_id]), rel_tol=1e-6)


def test_seed_gives_the_same_text_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate("Tell me a story about a fox.", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0, max_tokens=10)]
    batch = llm.generate(
        ["Hello there", "Tell me a story about a fox.", "Count to five:"],
        [others[0], params, others[1]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    different_seed = (
        llm.generate(
            "Tell me a story about a fox.",
            SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert different_seed != alone


def test_n_fans_out_with_distinct_seeds(llm):
    outputs = llm.generate(
        "Name a color:", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False
    )
    assert len(outputs) == 1 and [c.index for c in outputs[0].outputs] == [0, 1, 2]
    # choice j is the same sequence a single request with seed 5 + j draws (vLLM's rule)
    for j, choice in enumerate(outputs[0].outputs):
        alone = llm.generate(
            "Name a color:", SamplingParams(temperature=1.0, seed=5 + j, max_tokens=8), use_tqdm=False
        )[0]
        assert choice.token_ids == alone.outputs[0].token_ids


def test_penalties_at_checked_positions_count_the_draft_tokens_before_them():
    """Speculative decoding: position j of a request checking draft d is penalized as if d[:j]
    were output already (as plain decoding's step there would be)."""
    req = request(prompt=(1, 2), output=(3,), temperature=0, frequency_penalty=1.0)
    batch = InputBatch(1, 16, 1, 8, torch.device("cpu"))
    draft = [4, 4, 5]
    batch.update(SchedulerOutput(new_requests=[req], scheduled_spec_decode_tokens={"r": draft}))
    row = batch.row_of["r"]
    checked = batch.sampling_metadata([row] * 4, drafts_before=[0, 1, 2, 3])
    penalized = apply_penalties(torch.zeros(4, 8), checked.penalties)
    for j in range(4):
        counts = torch.bincount(torch.tensor([3, *draft[:j]]), minlength=8).float()
        assert torch.equal(penalized[j], -counts), j


def test_a_decode_step_reuses_the_metadata_until_the_rows_change():
    """The sampler's metadata is gathered again only when a row is taken or given back, or
    where it moves with the step (penalties count the output so far): each step it equals a
    fresh gather."""
    batch = InputBatch(3, 16, 1, 8, torch.device("cpu"))
    batch.update(SchedulerOutput(new_requests=[request("a", temperature=0.7, top_k=3, seed=1)]))
    rows = [batch.row_of["a"]]
    first = batch.sampling_metadata(rows)
    batch.append_tokens(rows, [[5]])
    assert batch.sampling_metadata(rows) is first
    batch.update(SchedulerOutput(new_requests=[request("b", frequency_penalty=1.0)]))
    rows = [batch.row_of["a"], batch.row_of["b"]]
    before = batch.sampling_metadata(rows)
    assert before is not first and before.penalties is not None
    batch.append_tokens(rows, [[6], [6]])
    after = batch.sampling_metadata(rows)
    assert after is not before and torch.equal(after.penalties.is_output.sum(1), torch.tensor([1]))
    batch.update(SchedulerOutput(finished_req_ids={"b"}))
    rows = [batch.row_of["a"]]
    again = batch.sampling_metadata(rows)
    assert again is not first and again.generators.keys() == {0}
    assert torch.equal(again.top_k, torch.tensor([3]))
