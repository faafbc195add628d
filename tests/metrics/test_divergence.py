"""The prefix divergence finder: a timestamp or a user's name inside a shared system prompt is
found at the right token with the right text; a clean shared prefix reports nothing to fix."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.prefix import make_clients, run_closed_loop
from pagedllm.core.block_hash import get_hash_function, hash_block_tokens
from pagedllm.entrypoints.cli.main import main
from pagedllm.metrics.divergence import DivergenceFinder, divergence

from ..helpers import TEST_ENGINE_ARGS

BLOCK = 16
RULES = "Answer briefly. Cite your sources. Never invent facts. Be polite to the user. " * 6
QUESTIONS = ["What is paged attention?", "Why is the sky blue?", "How do I boil an egg?", "Who wrote Hamlet?"]


def timestamp_prompt(i: int) -> str:
    stamp = f"2026-11-30 10:41:{7 + 2 * i:02d}"
    return f"You are a support assistant.\nCurrent time: {stamp}\n{RULES}\nQ: {QUESTIONS[i % 4]}"


def name_prompt(i: int) -> str:
    name = ["Alice", "Bartholomew", "Chen", "Dolores"][i % 4]
    return f"You are a support assistant for {name}.\n{RULES}\nQ: {QUESTIONS[i % 4]}"


def clean_prompt(i: int) -> str:
    return f"You are a support assistant.\n{RULES}\nQ: {QUESTIONS[i % 4]} (ticket {i})"


def chained_hashes(tokens: list[int]) -> list[bytes]:
    """The engine's own block keys (sha256, chained with the parent block's key)."""
    hash_fn, parent, hashes = get_hash_function("sha256"), None, []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK])
        hashes.append(parent)
    return hashes


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def run_finder(tokenizer, make_prompt, n: int = 12) -> tuple[list, list[list[int]]]:
    finder = DivergenceFinder(BLOCK, tokenizer.decode)
    prompts = [tokenizer(make_prompt(i)).input_ids for i in range(n)]
    for ids in prompts:
        finder.observe(ids, chained_hashes(ids))
    return finder.report(), prompts


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_a_timestamp_is_found_at_its_token_with_its_text(tokenizer):
    groups, prompts = run_finder(tokenizer, timestamp_prompt)
    assert len(groups) == 1
    [group] = groups
    assert group.requests == len(prompts) - 1  # every prompt after the first
    expected_start = min(first_difference(prompts[0], p) for p in prompts[1:])
    assert group.first_token == expected_start
    assert group.first_token <= len(
        tokenizer("You are a support assistant.\nCurrent time: 2026-11-30 10:41:").input_ids
    )
    assert group.last_token - group.first_token <= 3  # the seconds' digits, nothing more
    assert all("10:41:" in v and "[" in v for v in group.variants)
    rules_tokens = len(tokenizer(RULES).input_ids)
    assert group.shared_after_tokens // group.requests >= rules_tokens - BLOCK  # the rules agree again
    assert "move the variable part to the end" in group.sentence()


def test_a_user_name_of_any_length_is_found(tokenizer):
    groups, prompts = run_finder(tokenizer, name_prompt)
    assert len(groups) == 1
    [group] = groups
    assert group.requests == 3  # four names; the prompts after those repeat one exactly (full hits)
    names = {"Alice", "Bartholomew", "Chen", "Dolores"}
    assert all(any(n in v.split("[")[1].split("]")[0] for n in names) for v in group.variants)
    assert group.first_token == first_difference(prompts[0], prompts[1])


def test_a_clean_shared_prefix_reports_nothing_to_fix(tokenizer):
    groups, _ = run_finder(tokenizer, clean_prompt)
    assert groups == []


def test_divergence_handles_insertions_deletions_and_identity():
    base = list(range(100))
    assert divergence(base, base) is None
    assert divergence(base, base[:50]) is None  # a prefix: nothing differs
    inserted = [*base[:40], 999, 998, *base[40:]]
    d = divergence(inserted, base)
    assert (d.start, d.end, d.sibling_end, d.shared_after) == (40, 42, 40, 60)
    deleted = base[:40] + base[45:]
    d = divergence(deleted, base)
    assert (d.start, d.end, d.sibling_end) == (40, 40, 45)
    assert divergence(base[:40] + [7] * 60, base) is None  # never agree again


def test_memory_stays_within_its_budget(tokenizer):
    finder = DivergenceFinder(BLOCK, max_tokens=2_000)
    for i in range(200):
        ids = tokenizer(timestamp_prompt(i % 30)).input_ids
        finder.observe(ids, chained_hashes(ids))
    assert finder._num_tokens <= 2_000 + 300 and finder.num_prompts < 20
    assert len(finder._by_prefix) <= sum(len(p.block_hashes) for p in finder._prompts.values())


def test_the_engine_reports_what_it_served():
    llm = LLM(**TEST_ENGINE_ARGS)
    llm.generate([timestamp_prompt(i) for i in range(6)], SamplingParams(max_tokens=1), use_tqdm=False)
    [group] = llm.llm_engine.core.divergence.report()
    assert group.requests == 5 and "10:41:" in group.variants[0]


def test_analyze_prefix_names_the_timestamp_and_computes_the_moved_hit_rate(tmp_path, capsys):
    workload = tmp_path / "stamped.jsonl"
    workload.write_text(
        "".join(json.dumps({"prompt": timestamp_prompt(i), "max_tokens": 8}) + "\n" for i in range(20))
    )
    main(["analyze", "prefix", "--workload", str(workload), "--output-json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert "19 requests share 28 tokens, then differ at token 28.." in out and "10:41:" in out
    assert report["hit_rate_moved"] > report["hit_rate"] + 0.5  # the rules become shareable
    main(["analyze", "prefix", "--workload", str(workload), "--no-divergence-text"])
    assert "10:41:" not in capsys.readouterr().out


def test_analyze_prefix_replays_every_turn_as_the_benchmark_does(tmp_path, capsys, llm):
    """Answers of max_tokens tokens each (4: none ends sooner), so analyze's stand-ins are as long
    as the model's and its figure is the benchmark's to the token."""
    workload = tmp_path / "turns.jsonl"
    conversations = [
        {
            "conversation_id": i,
            "system": f"You help user {i}. {RULES}",
            "turns": QUESTIONS[i:],
            "max_tokens": 4,
        }
        for i in range(2)
    ]
    workload.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    main(["analyze", "prefix", "--workload", str(workload), "--output-json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert "2 conversations replayed turn by turn" in out and "7 prompts" in out

    engine = llm.llm_engine
    bench = run_closed_loop(engine, make_clients(str(workload), engine.tokenizer, None), concurrency=1)
    assert all(r.output_tokens == 4 for r in bench.records)  # the answer lengths analyze assumes
    assert report["prompt_tokens"] == sum(r.prompt_tokens for r in bench.records)
    assert report["hit_rate"] == pytest.approx(bench.hit_rate()) and report["hit_rate"] > 0.5
