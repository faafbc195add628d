"""Greedy float32 generation equals Hugging Face transformers on the same GGUF weights,
alone and inside a crowded batch with chunked prefill and mixed prefill/decode steps."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from ..helpers import CHATS, RAW_PROMPTS, TEST_ENGINE_ARGS, assert_greedy_equal, labelled_prompts

NEW_TOKENS = 64
FILLERS = [
    ("filler " * n + str(n)).strip() for n in (1, 3, 7, 12, 20, 33, 45, 60, 2, 5, 9, 14, 26, 38, 51, 70)
]


@pytest.fixture(scope="module")
def cases(reference):
    """(label, prompt token ids, reference tokens, reference logits) for the 8 prompts."""
    prompts = labelled_prompts(reference.tokenizer)
    generated = reference.greedy([ids for _, ids in prompts], NEW_TOKENS)
    pairs = zip(prompts, generated, strict=True)
    return [(label, ids, tokens, logits) for (label, ids), (tokens, logits) in pairs]


def test_prompts_tokenize_like_transformers(llm, cases):
    tokenizer = llm.get_tokenizer()
    for (label, ids, *_), text in zip(cases, RAW_PROMPTS, strict=False):
        assert tokenizer(text).input_ids == ids, label
    chat_output = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert chat_output.prompt_token_ids == cases[4][1]


@pytest.mark.slow  # the fast set keeps the crowded, chunked batch against transformers
def test_greedy_matches_transformers_one_at_a_time(llm, cases):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for label, ids, ref_tokens, ref_logits in cases:
        output = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert_greedy_equal(output.outputs[0].token_ids, ref_tokens, ref_logits, label)


def test_greedy_matches_transformers_in_a_crowded_chunked_batch(cases):
    budget = 32
    crowded = LLM(**TEST_ENGINE_ARGS, max_num_batched_tokens=budget, max_num_seqs=12)
    assert any(len(ids) > budget for _, ids, *_ in cases), "some prompt must need chunked prefill"
    tokenizer = crowded.get_tokenizer()
    prompts = [{"prompt_token_ids": ids} for _, ids, *_ in cases]
    fillers = [{"prompt_token_ids": tokenizer(text).input_ids} for text in FILLERS]
    mixed = [p for pair in zip(fillers[:8], prompts, strict=True) for p in pair] + fillers[8:]
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS if p in prompts else 8 + i % 13)
        for i, p in enumerate(mixed)
    ]
    outputs = crowded.generate(mixed, params, use_tqdm=False)
    by_prompt = {tuple(o.prompt_token_ids): o for o in outputs}
    for label, ids, ref_tokens, ref_logits in cases:
        assert_greedy_equal(
            by_prompt[tuple(ids)].outputs[0].token_ids, ref_tokens, ref_logits, f"{label} (batched)"
        )


def test_prefill_logits_match_transformers(llm, reference, cases):
    """The first sampled token's logprobs equal transformers' log-softmax at the last prompt position."""
    import torch

    label, ids, *_ = cases[3]
    output = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False
    )[0]
    ref = torch.log_softmax(reference.logits(ids)[-1], dim=-1)
    entry = output.outputs[0].logprobs[0]
    assert set(entry) >= set(ref.topk(5).indices.tolist()), label  # the top 5 are the reference's
    for token_id, logprob in entry.items():
        assert abs(logprob.logprob - float(ref[token_id])) < 1e-4, label


def test_prompt_logprobs_match_transformers_through_chunked_prefill(reference, cases):
    """Teacher-forced scoring through the paged path (what perplexity uses), chunk by chunk."""
    import torch

    _, ids, *_ = cases[3]
    chunked = LLM(**TEST_ENGINE_ARGS, max_num_batched_tokens=40, max_num_seqs=4)
    output = chunked.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    ref = torch.log_softmax(reference.logits(ids), dim=-1)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token = ids[position]
        assert abs(entry[token].logprob - float(ref[position - 1, token])) < 1e-4, position
        assert len(entry) <= 2
