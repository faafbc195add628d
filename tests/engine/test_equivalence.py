"""Every batching path gives the plain path's greedy output: preemption under a tiny pool,
chunk sizes, batch company. Divergence is accepted only at a near tie of the plain run
(top-2 logprob gap below 1e-3), read from its own logprobs. On the mechanism model (random
weights in the default model's head shapes): what is compared is our path against our plain
path, and its steps cost a fraction of the default model's."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [("word " * n).strip() + f" number {n}:" for n in (3, 9, 17, 25, 33, 41, 50, 58, 66, 74, 5, 12)]
MAX_TOKENS = 40


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - (i % 5), ignore_eos=True, logprobs=2)


def assert_same_or_near_tie(outputs, baseline, label: str) -> None:
    for out, base in zip(outputs, baseline, strict=True):
        ours, theirs = out.outputs[0].token_ids, base.outputs[0].token_ids
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                top = sorted((lp.logprob for lp in base.outputs[0].logprobs[step].values()), reverse=True)
                assert top[0] - top[1] < 1e-3, f"{label}: step {step} differs with gap {top[0] - top[1]:.2e}"
                break


@pytest.fixture(scope="module")
def baseline(mechanism_args):
    """Each prompt alone in a big pool: the plain path."""
    llm = LLM(**mechanism_args)
    return [llm.generate(p, _params(i), use_tqdm=False)[0] for i, p in enumerate(PROMPTS)]


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_preemption_under_a_tiny_pool_gives_the_same_outputs(mechanism_args, baseline):
    # 10 blocks of 16 = 160 slots for 12 requests of 20-110 tokens: preemption is certain.
    tiny = LLM(**{**mechanism_args, "max_model_len": 160}, num_gpu_blocks_override=10)
    outputs = tiny.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    assert tiny.llm_engine.get_stats().num_preemptions > 0
    assert_same_or_near_tie(outputs, baseline, "tiny pool")
    pool = tiny.llm_engine.core.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
@pytest.mark.parametrize("budget, partial_prefills", [(16, None), (23, None), (64, 1)])
def test_chunk_sizes_give_the_same_outputs(mechanism_args, baseline, budget, partial_prefills):
    chunked = LLM(
        **mechanism_args,
        max_num_batched_tokens=budget,
        max_num_seqs=budget,
        max_num_partial_prefills=partial_prefills,
    )
    outputs = chunked.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    assert_same_or_near_tie(outputs, baseline, f"budget {budget}, partial prefills {partial_prefills}")


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_one_token_prefill_chunks_give_the_same_outputs(mechanism_args, baseline):
    single = LLM(**mechanism_args, max_num_batched_tokens=1, max_num_seqs=1)
    outputs = single.generate(PROMPTS[:3], [_params(i) for i in range(3)], use_tqdm=False)
    assert_same_or_near_tie(outputs, baseline[:3], "chunk 1")


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_the_pytorch_attention_path_gives_the_same_outputs(mechanism_args, baseline, monkeypatch):
    """The path CUDA takes (gather + SDPA, decode batches grouped by length, prefill spans over a
    cached context), run through the runner here on CPU: chunked prefill and prefix hits included."""
    from pagedllm.attention.backend import TorchBackend
    from pagedllm.worker import model_runner

    monkeypatch.setattr(model_runner, "select_backend", lambda device, dtype, *_: TorchBackend(dtype))
    torch_path = LLM(**mechanism_args, max_num_batched_tokens=32, max_num_seqs=32)
    assert isinstance(torch_path.llm_engine.core.executor.driver_worker.runner.attn_backend, TorchBackend)
    params = [_params(i) for i in range(len(PROMPTS))]
    outputs = torch_path.generate(PROMPTS, params, use_tqdm=False)
    assert_same_or_near_tie(outputs, baseline, "PyTorch attention")
    again = torch_path.generate(PROMPTS[-4:], params[-4:], use_tqdm=False)  # their prefixes now hit
    assert torch_path.llm_engine.get_stats().prefix_cache.hits > 0
    assert_same_or_near_tie(again, baseline[-4:], "PyTorch attention, prefix hits")


SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def _without_logprobs(i: int) -> SamplingParams:
    """_params(i) without logprobs, which a request checking draft tokens may not ask for."""
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - (i % 5), ignore_eos=True)


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
@pytest.mark.parametrize("budget", [None, 23])
def test_speculative_decoding_gives_the_same_outputs(mechanism_args, baseline, budget):
    """n-gram drafts checked in the batch (beside prefill chunks where the budget is small):
    the plain path's tokens, exactly as many, some drafts accepted and some rejected."""
    sizes = {"max_num_batched_tokens": budget, "max_num_seqs": budget} if budget else {}
    spec = LLM(**mechanism_args, speculative_config=SPECULATIVE, **sizes)
    outputs = spec.generate(PROMPTS, [_without_logprobs(i) for i in range(len(PROMPTS))], use_tqdm=False)
    assert_same_or_near_tie(outputs, baseline, f"speculative, budget {budget}")
    assert [len(o.outputs[0].token_ids) for o in outputs] == [len(b.outputs[0].token_ids) for b in baseline]
    stats = spec.llm_engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_suffix_decoding_gives_the_same_outputs(mechanism_args, baseline):
    """Suffix drafts (from each request's own context and from the outputs before it, the
    prompts run twice so the second round can draft from the first): the plain path's tokens."""
    spec = LLM(**mechanism_args, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    params = [_without_logprobs(i) for i in range(len(PROMPTS))]
    lengths = [len(b.outputs[0].token_ids) for b in baseline]
    for turn in ("first", "second"):
        outputs = spec.generate(PROMPTS, params, use_tqdm=False)
        assert_same_or_near_tie(outputs, baseline, f"suffix decoding, {turn} round")
        assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert spec.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_speculative_decoding_under_a_tiny_pool_gives_the_same_outputs(mechanism_args, baseline):
    tiny = LLM(
        **{**mechanism_args, "max_model_len": 160},
        num_gpu_blocks_override=10,
        speculative_config=SPECULATIVE,
    )
    outputs = tiny.generate(PROMPTS, [_without_logprobs(i) for i in range(len(PROMPTS))], use_tqdm=False)
    stats = tiny.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert_same_or_near_tie(outputs, baseline, "speculative, tiny pool")
    pool = tiny.llm_engine.core.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
