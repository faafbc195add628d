"""Speculative decoding: its settings, the n-gram proposer, the check of draft tokens (greedy and
rejection sampling, whose output must be distributed as plain sampling's), the step-cost model
behind its back-off, and the engine with it on: stop conditions and aborts as without it."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.draft_policy import DraftPolicy
from pagedllm.core.step_cost import StepCostModel
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.request import RequestStatus
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection import RejectionSampler
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.speculative_config import SpeculativeConfig

from ..helpers import TEST_ENGINE_ARGS, FreeRows, fake_run, make_request, make_scheduler, rows_free

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


# ---- settings ----------------------------------------------------------------------------------


def test_config_reads_vllm_json_and_names_what_is_wrong():
    config = SpeculativeConfig.parse(
        json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    )
    assert config == SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert SpeculativeConfig.parse(None) is None
    for bad, names in [
        ('{"method": "ngram", "model": "draft-1b"}', "unknown key(s) model"),
        ('{"num_speculative_tokens": 2}', "speculative_config.method: required"),
        ('{"method": "eagle"}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 1e30}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_max"),
        ("[1, 2]", "must be a JSON object"),
        ("{method: ngram}", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(")", r"\)")):
            SpeculativeConfig.parse(bad)


# ---- the n-gram proposer -----------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], dtype=np.int32)
    # [1, 2, 3] (n = 3) occurred at 0, followed by 4 5 9; [2, 3] later at 6 loses to the longer match
    assert proposer.propose("r", tokens, 3) == [4, 5, 9]
    assert proposer.propose("r", tokens, 1) == [4]
    assert proposer.propose("r", np.array([5, 6, 7], dtype=np.int32), 3) == []
    assert NgramProposer(min_n=2, max_n=2).propose("r", np.array([1, 2, 9, 2], dtype=np.int32), 3) == []
    # the latest earlier occurrence of the longest match wins
    assert proposer.propose("r", np.array([4, 1, 4, 2, 4], dtype=np.int32), 2) == [2, 4]


# ---- checking draft tokens ---------------------------------------------------------------------


def _metadata(num_rows: int, greedy: bool) -> SamplingMetadata:
    return SamplingMetadata(
        all_greedy=greedy,
        is_greedy=torch.full((num_rows,), greedy),
        temperature=torch.ones(num_rows),
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        penalties=None,
        logit_bias=None,
        banned=None,
        num_logprobs=[None] * num_rows,
    )


def test_greedy_check_keeps_the_argmax_run_and_corrects_the_first_miss():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [5.0, 0, 0, 0], [0, 0, 0, 5]])
    sampler = RejectionSampler(Sampler(torch.device("cpu"), seed=0))
    # argmaxes 1 2 0 3: drafts [1, 2, 3] -> 1, 2 accepted, 3 replaced by 0; a full match gets 1 more
    assert sampler(logits, _metadata(4, True), [[1, 2, 3]])[0] == [[1, 2, 0]]
    assert sampler(logits[:3], _metadata(3, True), [[1, 2]])[0] == [[1, 2, 0]]
    assert sampler(logits, _metadata(4, True), [[3], [2]])[0] == [[1], [0]]


def _chi_square_p_value(observed: Counter, expected: dict[int, float], n: int) -> float:
    """P(X >= statistic) for X ~ chi-square with len(expected) - 1 degrees of freedom (the
    Wilson-Hilferty approximation: good to ~1e-3 here, and the test's threshold is 1e-4)."""
    statistic = sum((observed[k] - n * p) ** 2 / (n * p) for k, p in expected.items())
    assert sum(observed.values()) == sum(observed[k] for k in expected), "a token outside the support"
    dof = len(expected) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_draws_each_token_from_the_target_distribution():
    """Drafts [1, 2] against targets p0, p1, p2: the first token must be distributed as p0
    (accepted with p0(1), else drawn from the residual), the second, given the first was the
    draft, as p1, and the one after a full match as p2."""
    logits = torch.tensor([[0.0, 0.3, -0.5, 1.0], [0.2, -1.0, 0.7, 0.1], [1.0, 0.0, -0.3, 0.4]])
    probs = torch.softmax(logits, dim=-1).tolist()
    sampler = RejectionSampler(Sampler(torch.device("cpu"), seed=1))
    firsts: Counter = Counter()
    seconds: Counter = Counter()
    thirds: Counter = Counter()
    n = 8_000
    for _ in range(n):
        tokens = sampler(logits, _metadata(3, False), [[1, 2]])[0][0]
        firsts[tokens[0]] += 1
        if tokens[0] == 1:
            seconds[tokens[1]] += 1
            if tokens[1] == 2:
                thirds[tokens[2]] += 1
    for observed, p in ((firsts, probs[0]), (seconds, probs[1]), (thirds, probs[2])):
        total = sum(observed.values())
        assert total > 300
        assert _chi_square_p_value(observed, dict(enumerate(p)), total) > 1e-4, (observed, p)


# ---- when a draft row is worth checking --------------------------------------------------------


def test_step_cost_model_recovers_a_linear_step_time():
    model = StepCostModel()
    assert model.row_cost(8) == 0.0  # nothing measured: rows taken as free
    for rows in [1, 4, 16, 64, 256, 1, 8, 32] * 10:
        model.record(rows, 0.010 + 0.0005 * rows)
    t0, t1 = model.coefficients()
    assert t0 == pytest.approx(0.010, rel=1e-6) and t1 == pytest.approx(0.0005, rel=1e-6)
    assert model.row_cost(1) == pytest.approx(0.0005 / 0.0105)
    assert 0 < model.row_cost(4) < model.row_cost(64) < 1


@pytest.mark.parametrize(("timed", "free_rows"), [(True, False), (False, False), (True, True)])
def test_a_request_whose_drafts_were_rejected_stops_checking_them_where_rows_are_dear(timed, free_rows):
    """The draft policy's back-off: where the steps' timings say a row costs most of a step, a
    request whose drafts were all rejected checks none the next step (until a probe); where nothing
    was timed, or the scheduler was given a policy whose rows are free, it keeps checking them."""
    policy = DraftPolicy(SpeculativeConfig(**NGRAM), FreeRows()) if free_rows else None
    scheduler = make_scheduler(speculative_config=NGRAM, draft_policy=policy)
    if timed:
        for rows in (1, 16, 1, 16):
            scheduler.record_step_time(rows, 0.001 + 0.01 * rows)
    scheduler.add_request(make_request("r", 6, max_tokens=20))
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_run(scheduler, output, token=3, next_draft=[7, 8, 9]))
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {"r": [7, 8, 9]}  # nothing rejected yet
    runner_output = fake_run(scheduler, output, token=4, num_accepted=0, next_draft=[7, 8, 9])
    scheduler.update_from_output(output, runner_output)
    output = scheduler.schedule()
    rows_dear = timed and not free_rows
    assert output.scheduled_spec_decode_tokens == ({} if rows_dear else {"r": [7, 8, 9]})


def test_the_draft_policy_forgets_a_request_preempted_or_ended():
    """A preempted request's proposal is dropped (its record kept); an ended one leaves nothing."""
    scheduler = make_scheduler(speculative_config=NGRAM)
    policy = scheduler.draft_policy
    assert policy is not None
    scheduler.add_request(request := make_request("r", 6, max_tokens=20))
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_run(scheduler, output, token=3, next_draft=[7, 8, 9]))
    output = scheduler.schedule()
    runner_output = fake_run(scheduler, output, token=4, num_accepted=1, next_draft=[7, 8, 9])
    scheduler.update_from_output(output, runner_output)
    assert policy.drafts_to_check(request, 7, 1) == [7, 8, 9]
    assert policy.acceptance("r") == pytest.approx(2 / 4)
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (3, 1)
    scheduler._preempt(scheduler.running.pop())
    assert policy.drafts_to_check(request, 7, 1) == []
    assert policy.acceptance("r") == pytest.approx(2 / 4)
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert policy.acceptance("r") == 1.0  # nothing kept
    assert not policy._proposals and not policy._recent


# ---- the engine with speculation on ------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    """Four requests at a time, draft rows taken as free (the back-off leaves drafts on)."""
    return rows_free(LLM(**TEST_ENGINE_ARGS, speculative_config=NGRAM, max_num_seqs=4))


REPETITIVE = "one two three four five six seven eight nine ten. " * 4 + "Again: one two three"


@pytest.mark.slow  # two engines over every stop rule
def test_stop_conditions_end_where_they_end_without_speculation(llm, spec_llm):
    """A stop token, a stop string or max_tokens reached inside a run of accepted draft tokens
    ends the output exactly where plain decoding ends it."""
    plain = llm.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    tokens, text = plain.outputs[0].token_ids, plain.outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tokens[11]]),
        SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop=[text[len(text) // 2 : len(text) // 2 + 6]]
        ),
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            stop=[text[len(text) // 3 : len(text) // 3 + 5]],
            include_stop_str_in_output=True,
        ),
    ]
    for params in cases:
        want = llm.generate(REPETITIVE, params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.generate(REPETITIVE, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        ), params
    assert spec_llm.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_logprobs_with_speculation_are_plain_decoding_s(llm, spec_llm):
    """A request asking for logprobs checks drafts too; each token's logprobs (its own and the
    top 3) come from its own position, as plain decoding reports them; a stop string inside an
    accepted run cuts them with the tokens."""
    plain = llm.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = plain.outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0, stop=[text[20:26]]),
    ]
    for params in cases:
        want = llm.generate(REPETITIVE, params, use_tqdm=False)[0]
        got = spec_llm.generate(REPETITIVE, params, use_tqdm=False)[0]
        assert got.draft_tokens is not None and got.draft_tokens[1] > 0, "drafts were checked and kept"
        w, g = want.outputs[0], got.outputs[0]
        assert (g.token_ids, g.text) == (w.token_ids, w.text)
        assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for position, (w_entry, g_entry) in enumerate(zip(w.logprobs, g.logprobs, strict=True)):
            assert list(g_entry) == list(w_entry), position  # the same tokens, in rank order
            for token_id, entry in w_entry.items():
                assert g_entry[token_id].rank == entry.rank
                assert g_entry[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.1},
        pytest.param({"frequency_penalty": 0.3}, marks=pytest.mark.slow),
        pytest.param({"presence_penalty": 0.5}, marks=pytest.mark.slow),
    ],
)
def test_penalties_count_the_draft_tokens_before_each_position(llm, spec_llm, penalty):
    """Greedy with a penalty: each checked position is penalized for the draft tokens before it
    as plain decoding penalizes the tokens it sampled, so the tokens are plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalty)
    want = llm.generate(REPETITIVE, params, use_tqdm=False)[0]
    got = spec_llm.generate(REPETITIVE, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.draft_tokens is not None and got.draft_tokens[1] > 0, "drafts were checked and kept"


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_a_seeded_request_samples_the_same_tokens_with_speculation(llm, spec_llm):
    """A seed fixes the draws: with speculation the request draws position by position from its
    own generator as plain sampling does, so its tokens are the same, while it still keeps the
    drafts its draws agree with; alone, and in a batch where an unseeded sampled row and a greedy
    row are checked beside it."""
    kept = 0
    seeded = [
        SamplingParams(temperature=0.7, top_k=8, max_tokens=40, ignore_eos=True, seed=seed)
        for seed in range(4)
    ]
    wants = []
    for seed, params in enumerate(seeded):
        want = llm.generate(REPETITIVE, params, use_tqdm=False)[0]
        got = spec_llm.generate(REPETITIVE, params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, seed
        assert got.draft_tokens is not None
        kept += got.draft_tokens[1]
        wants.append(want.outputs[0].token_ids)
    assert kept > 0, "drafts were checked and kept"

    unseeded = SamplingParams(temperature=0.7, top_k=8, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    mixed = [unseeded, seeded[0], greedy, seeded[1]]  # one step's rows (max_num_seqs 4)
    outputs = spec_llm.generate([REPETITIVE] * len(mixed), mixed, use_tqdm=False)
    assert [outputs[i].outputs[0].token_ids for i in (1, 3)] == wants[:2]
    assert sum(output.draft_tokens[1] for output in outputs if output.draft_tokens) > 0
    want_greedy = llm.generate(REPETITIVE, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[2].outputs[0].token_ids == want_greedy
    assert all(len(output.outputs[0].token_ids) == 40 for output in outputs)


def test_aborts_while_checking_drafts_give_every_block_back(spec_llm):
    engine: LLMEngine = spec_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for round_ in range(3):
        ids = [f"abort-{round_}-{i}" for i in range(12)]
        for i, req_id in enumerate(ids):
            engine.add_request(req_id, REPETITIVE + f" {i}", params)
        for _ in range(4 + round_):
            engine.step()
        engine.abort_request(ids[::2])
        engine.step()
        engine.abort_request(ids[1::2])
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().spec_decode.num_draft_tokens > 0
    pool = engine.core.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_sampled_output_keeps_its_distribution_with_speculation(llm, spec_llm):
    """Temperature 1 over the top two tokens, three tokens a request (the second and third
    checked as drafts where the n-gram proposer finds them): the joint distribution of the
    continuations with speculation is that of plain sampling (chi-square, two samples)."""
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
    n = 400
    samples = {}
    for name, engine in (("plain", llm), ("spec", spec_llm)):
        before = engine.llm_engine.get_stats().spec_decode
        drafts_before = before.num_draft_tokens if before else 0
        outputs = [
            out for _ in range(n // 16) for out in engine.generate([REPETITIVE] * 16, params, use_tqdm=False)
        ]
        samples[name] = Counter(tuple(o.outputs[0].token_ids) for o in outputs)
        after = engine.llm_engine.get_stats().spec_decode
        if name == "spec":
            assert after.num_draft_tokens - drafts_before > n // 4, "drafts were checked"
    cells = sorted(set(samples["plain"]) | set(samples["spec"]))
    statistic = 0.0
    for cell in cells:
        a, b = samples["plain"][cell], samples["spec"][cell]
        statistic += (a - b) ** 2 / (a + b)  # two equal-size samples
    dof = len(cells) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-4, samples


# ---- served -------------------------------------------------------------------------------------


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_served_with_speculation_reports_drafts_everywhere_vllm_users_look(tmp_path):
    """--speculative-config on the server: the start-up line, vLLM's spec_decode_* families on
    /metrics, acceptance in /stats, the response's timings (llama.cpp's draft_n fields), and a
    bad setting refused at start with its name."""
    import httpx

    from ..helpers import MODEL, RemoteServer, server_engine_args

    server = RemoteServer([*server_engine_args(), "--speculative-config", json.dumps(NGRAM)])
    try:
        assert any("Speculative decoding: ngram, up to 4 draft tokens" in line for line in server.lines)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            body = {"model": MODEL, "prompt": REPETITIVE, "max_tokens": 24, "temperature": 0}
            response = http.post("/v1/completions", json=body | {"ignore_eos": True})
            assert response.status_code == 200, response.text
            timings = response.json()["timings"]
            assert timings["draft_n"] >= timings["draft_n_accepted"] > 0
            stats = http.get("/stats").json()["spec_decode"]
            assert stats["num_accepted_tokens"] == timings["draft_n_accepted"]
            assert stats["mean_acceptance_length"] > 1
            metrics = http.get("/metrics").text
            for family in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                assert f"pagedllm:spec_decode_{family}_total{{" in metrics
            assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="' in metrics
            schema = {  # the grammar's forced keys are drafts too
                "type": "object",
                "properties": {"first_word": {"type": "string"}, "second_word": {"type": "string"}},
                "required": ["first_word", "second_word"],
                "additionalProperties": False,
            }
            response = http.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "The first two words of: " + REPETITIVE}],
                    "max_tokens": 60,
                    "temperature": 0,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "w", "schema": schema},
                    },
                },
            )
            assert response.status_code == 200, response.text
            assert set(json.loads(response.json()["choices"][0]["message"]["content"])) == set(
                schema["properties"]
            )
            assert response.json()["timings"]["draft_n_accepted"] > 0
            _bench_serve_reports_each_requests_drafts(server, http, tmp_path)
    finally:
        server.stop()
    # a bad setting: refused before any model loads, as the flag's JSON text (the server prints it
    # after "error: "; a start ended so is tests/engine/test_kv_offload.py's)
    with pytest.raises(ValueError, match=r"unknown key\(s\) draft_model"):
        EngineConfig(**(TEST_ENGINE_ARGS | {"speculative_config": '{"method": "ngram", "draft_model": "x"}'}))


def _bench_serve_reports_each_requests_drafts(server, http, tmp_path) -> None:
    """`pagedllm bench serve` (the real client, streaming chat) keeps each request's draft counts
    from its last chunk's timings, and they add up to what the server counted meanwhile."""
    from pagedllm.entrypoints.cli.main import main as cli

    workload, out = tmp_path / "chats.jsonl", tmp_path / "report.json"
    lines = [
        {"conversation_id": i, "turns": [REPETITIVE * (i + 1)], "max_tokens": 24, "ignore_eos": True}
        for i in range(2)
    ]
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    before = http.get("/stats").json()["spec_decode"]
    cli(["bench", "serve", "--base-url", server.url, "--workload", str(workload), "--output-json", str(out)])
    after = http.get("/stats").json()["spec_decode"]
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert all(r["draft_tokens"] >= r["accepted_draft_tokens"] >= 0 for r in requests)
    drafts, accepted = (sum(r[key] for r in requests) for key in ("draft_tokens", "accepted_draft_tokens"))
    assert drafts > 0  # how many are accepted depends on the text, which differs between hosts
    assert drafts == after["num_draft_tokens"] - before["num_draft_tokens"]
    assert accepted == after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert report["draft_acceptance_rate"] == pytest.approx(accepted / drafts)


def _ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force: the longest n, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 5),
)
def test_ngram_proposer_matches_its_definition(tokens, min_n, extra, k):
    proposer = NgramProposer(min_n, min_n + extra)
    got = proposer.propose("r", np.array(tokens, dtype=np.int32), k)
    assert got == _ngram_reference(tokens, min_n, min_n + extra, k)
