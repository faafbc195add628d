"""Greedy bfloat16 generation agrees with Hugging Face transformers in bfloat16 on the same weights.

Two bfloat16 implementations cannot be token-exact: their sums round in different orders, and
logits near 20 are only representable to 0.125. So the rule has a margin, and the margin is
measured here, not chosen: `noise` is how far transformers' own bfloat16 logprobs sit from its
float32 ones on the same tokens (what bfloat16 arithmetic alone moves them). Two bfloat16
computations may each be off by that much, so:
- where our token equals the reference's, our top-5 logprobs are within 2 x noise of its;
- a different token is accepted only where the reference's top-2 logprob gap is below 2 x noise
  (a near tie that either rounding may flip); the comparison of that prompt stops there.
A wrong model fails at its first step (its logprobs are off, or it picks another token where the
reference has no near tie).
Runs whatever dtype `auto` picks on the host; bfloat16 is pinned here.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pagedllm import LLM, SamplingParams

from ..conftest import Reference
from ..helpers import TEST_ENGINE_ARGS, labelled_prompts

pytestmark = pytest.mark.slow  # a bfloat16 transformers reference loaded for one test

NEW_TOKENS = 16  # bfloat16 without hardware support is slow (transformers' and ours)
PROMPTS_TAKEN = (1, 3, 4, 5)
"""Of helpers.labelled_prompts: code, the long text, a chat with and one without a system prompt."""


@pytest.fixture(scope="module")
def bf16_cases(reference):
    """(label, prompt ids, reference tokens, reference logprobs per step, noise per step)."""
    ref16 = Reference(copy.deepcopy(reference.model).to(torch.bfloat16), reference.tokenizer)
    prompts = [labelled_prompts(reference.tokenizer)[i] for i in PROMPTS_TAKEN]
    generated = ref16.greedy([ids for _, ids in prompts], NEW_TOKENS)
    cases = []
    for (label, ids), (tokens, logits) in zip(prompts, generated, strict=True):
        logprobs = torch.log_softmax(torch.stack(logits), dim=-1)
        # float32 on the very same tokens: what bfloat16 rounding alone changed
        exact = torch.log_softmax(reference.logits(ids + tokens[:-1])[len(ids) - 1 :], dim=-1)
        top = logprobs.topk(5, dim=-1).indices
        noise = (exact.gather(1, top) - logprobs.gather(1, top)).abs().amax(dim=-1)
        cases.append((label, ids, tokens, logprobs, noise))
    return cases


def _compare(ours, cases) -> None:
    """Checks the rule above for every prompt."""
    margin = 2 * max(float(noise.max()) for *_, noise in cases)
    for output, (label, _, ref_tokens, ref_logprobs, _) in zip(ours, cases, strict=True):
        completion = output.outputs[0]
        for step, (token, ref_token) in enumerate(zip(completion.token_ids, ref_tokens, strict=False)):
            if token != ref_token:
                top2 = ref_logprobs[step].topk(2).values
                gap = float(top2[0] - top2[1])
                assert gap < margin, (
                    f"{label}: step {step}: {token} != {ref_token}, top-2 gap {gap:.3f} >= {margin:.3f}"
                )
                break
            for token_id, logprob in completion.logprobs[step].items():
                diff = abs(logprob.logprob - float(ref_logprobs[step, token_id]))
                assert diff < margin, f"{label}: step {step}: token {token_id} logprob off by {diff:.3f}"


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM(**(TEST_ENGINE_ARGS | {"dtype": "bfloat16"}))


def test_bf16_greedy_agrees_with_transformers_bf16_alone_and_batched(bf16_llm, bf16_cases):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for _, ids, *_ in bf16_cases]
    alone = [bf16_llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    batched = bf16_llm.generate(prompts, params, use_tqdm=False)
    for outputs in (alone, batched):
        _compare(outputs, bf16_cases)
