"""EngineCore alone: a tiny model whose folder has no tokenizer at all, token ids in and out (the
front ends own text), and what crosses the line: EngineRequest in, EngineCoreOutput and ModelFacts
out, plain values."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import EngineRequest
from pagedllm.engine.model_source import ModelSource
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.kv_cache import KVCachePlan, KVCacheSpec

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT = [5, 17, 99, 3, 42, 42, 7, 200, 13, 64, 1, 250]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-no-tokenizer")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(path)
    assert not list(path.glob("tokenizer*"))  # a tokenizer load would fail here
    return path


@pytest.fixture(scope="module")
def core(folder):
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=32,
        disable_log_stats=True,
    )
    core = EngineCore(config, ModelSource.resolve(config))
    yield core
    core.close()


def request(req_id: str, max_tokens: int, prompt: list[int] = PROMPT) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(req_id, list(prompt), params, max_tokens=max_tokens, arrival_time=0.0)


def run_to_end(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            outputs.setdefault(output.req_id, []).append(output)
    return outputs


def test_the_facts_cross_once_as_a_frozen_value(core):
    facts = core.facts
    assert (facts.max_model_len, facts.vocab_size, facts.num_kv_blocks) == (128, 256, 32)
    assert (facts.dtype, facts.device, facts.tp_size) == ("float32", "cpu", 1)
    assert facts.model_config.eos_token_ids == (2,)
    with pytest.raises(AttributeError):
        facts.max_model_len = 1  # type: ignore[misc]


def test_token_ids_in_greedy_tokens_out_as_transformers_gives_them(core, folder):
    from transformers import AutoModelForCausalLM

    core.add_request(request("a", max_tokens=6))
    outputs = run_to_end(core)["a"]
    tokens = [t for output in outputs for t in output.new_token_ids]
    assert outputs[-1].finish_reason == "length" and len(tokens) == 6

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert tokens == expected
    pool = core.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks  # all back once finished


def test_a_front_end_ends_requests_and_the_others_go_on(core):
    """An abort, or a stop string a front end found in the text: finish_requests, blocks freed."""
    core.add_request(request("stays", max_tokens=4))
    core.add_request(request("goes", max_tokens=50))
    with pytest.raises(ValueError, match="'goes' is already in use"):
        core.add_request(request("goes", max_tokens=1))
    core.step()
    core.finish_requests(["goes", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert core.get_num_unfinished_requests() == 1
    outputs = run_to_end(core)
    assert set(outputs) == {"stays"} and outputs["stays"][-1].finish_reason == "length"
    pool = core.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and core.get_stats().num_running_reqs == 0


def test_the_kv_report_lines_keep_the_words_users_grep_for():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, cache_dtype="int8")
    plan = KVCachePlan(spec, budget_bytes=2**30, num_blocks=1000, max_model_len=4096)
    assert plan.describe() == [
        "Available KV cache memory: 1.00 GiB",
        "KV cache: 1,000 blocks of 16 tokens, 528 bytes per token (int8, 16 of them scales)",
        "KV cache size: 16,000 tokens",
        "Maximum concurrency for 4,096 tokens per request: 3.91x",
    ]
    two_ranks = plan.describe(tp_size=2, on_cuda=True)
    assert two_ranks[0] == "Available KV cache memory: 1.00 GiB per rank"
    assert two_ranks[2] == "GPU KV cache size: 16,000 tokens"
    assert two_ranks[3] == (
        "KV cache per rank: 16,000 tokens (1,000 blocks, 0.01 GiB, 2 of 4 KV heads); "
        "total over 2 ranks: 0.02 GiB"
    )
