"""Bad input gets a clear ValueError before it touches the engine; other requests are unaffected."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig, parse_memory_size


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),
        ({"top_k": 10**30}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"stop": ["\ud800"]}, "stop"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_vllm_spellings_of_no_top_k_are_accepted():
    assert SamplingParams(top_k=-1).top_k is None
    assert SamplingParams(top_k=0).top_k is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
        ({"block_size": 12}, "block_size"),
        ({"dtype": "float64"}, "dtype"),
        ({"kv_cache_memory_bytes": "lots"}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_invalid_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**kwargs)


def test_memory_sizes_parse():
    assert parse_memory_size("4GiB") == 4 * 2**30
    assert parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("2GB") == 2 * 10**9
    assert parse_memory_size("1000") == 1000
    assert EngineConfig(max_num_seqs=4096).max_num_batched_tokens == 4096


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_bad_requests_are_rejected_and_the_batch_is_unaffected(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = llm.generate(["A good request", "Another good one"], params, use_tqdm=False)

    engine.add_request("good-0", "A good request", params)
    engine.step()  # the good request is running when the bad ones arrive
    too_long = "word " * 2000
    bad = [
        ("", params, "prompt: the prompt is empty"),
        (too_long, params, "leave no room to generate within max_model_len"),
        ("fine prompt", SamplingParams(max_tokens=1024), "max_tokens: prompt .* over max_model_len"),
        ({"prompt_token_ids": []}, params, "prompt_token_ids"),
        ({"prompt_token_ids": [10**9]}, params, "prompt_token_ids"),
        ("fine prompt", SamplingParams(logprobs=1000), "logprobs"),
        ("fine prompt", SamplingParams(prompt_logprobs=1000), "prompt_logprobs"),
        ("fine prompt", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("fine prompt", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        ("a lone \udc00 surrogate", params, "prompt: holds a lone surrogate"),
    ]
    blocks_before = engine.core.kv_cache_manager.block_pool.num_free_blocks
    for prompt, p, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(None, prompt, p)
    long_prompt = "word " * 40  # over a block: its hash would carry the salt
    for field, value in (("cache_salt", "\ud800"), ("user", "\ud800"), ("user", "u" * 257)):
        with pytest.raises(ValueError, match=f"^{field}:"):
            engine.add_request(None, long_prompt, params, **{field: value})
    assert engine.core.kv_cache_manager.block_pool.num_free_blocks == blocks_before
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-0", "duplicate id", params)
    engine.add_request("good-1", "Another good one", params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert finished == {
        "good-0": expected[0].outputs[0].token_ids,
        "good-1": expected[1].outputs[0].token_ids,
    }


def test_generate_with_one_bad_prompt_raises_and_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="prompt: the prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_model_len_that_cannot_fit_fails_at_start_saying_what_to_change():
    from pagedllm import LLM

    with pytest.raises(
        ValueError, match=r"max_model_len 1,024 needs 64 KV cache blocks.*lower --max-model-len"
    ):
        LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes="1MiB")


def test_a_request_whose_sampling_fails_ends_alone_with_an_error(llm, monkeypatch):
    """The batched sampler raising falls back to one request at a time: only the one at fault
    fails (finish_reason "error", its blocks freed), the others get the tokens they get alone."""
    from pagedllm.sample.sampler import Sampler

    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["A good request", "Another good one"]
    expected = llm.generate(prompts, params, use_tqdm=False)
    sample = Sampler.__call__

    def faulty(self, logits, metadata):
        if any(g.initial_seed() == 666 for g in metadata.generators.values()):
            raise RuntimeError("injected")
        return sample(self, logits, metadata)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    bad = SamplingParams(temperature=0.5, max_tokens=8, seed=666)
    outputs = llm.generate([*prompts, "A bad one"], [params, params, bad], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [e.outputs[0].token_ids for e in expected]
    assert outputs[2].outputs[0].finish_reason == "error" and "injected" in outputs[2].error
    pool = llm.llm_engine.core.kv_cache_manager.block_pool
    assert not llm.llm_engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
