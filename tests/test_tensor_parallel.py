"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens, token for token, through
prefix hits and preemptions, with both executor backends; sizes that split no head are refused;
a rank killed under a running server ends the server, non-zero, saying which rank and how."""

from __future__ import annotations

import shutil
import signal
import time

import httpx
import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import ServerProcess
from pagedllm.distributed import shm_all_reduce
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.loader import default_model_path
from pagedllm.planner import MemoryBudget, config_from_numbers, plan_capacity

# 4 heads / 2 KV heads (head_dim 64: the kernel's AVX-512 path), tied embeddings like SmolLM2.
TINY_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}
# 40 blocks of 16 tokens for 8 requests of up to ~110 tokens: the scheduler must preempt.
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "num_gpu_blocks_override": 40,
    "max_num_seqs": 8,
    "disable_log_stats": True,
}
PROMPTS = [f"Story {i}: once upon a time there was a" + " very" * (i * 7) for i in range(8)]
PROMPTS += [PROMPTS[3] + " and then", PROMPTS[5] + " but"]  # prefix hits on whole blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama-4-heads")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA), dtype=torch.float32)
    model.save_pretrained(folder)
    for file in converted_folder(default_model_path()).glob("tokenizer*"):
        shutil.copy(file, folder)
    return str(folder)


def generate(model: str, **engine_args) -> tuple[list[list[int]], int, int, str | None]:
    """Greedy tokens of PROMPTS, the preemptions and the prefix-cache hit tokens it took, and
    how rank 0 all-reduces (None with one rank)."""
    llm = LLM(model, **ENGINE_ARGS, **engine_args)
    tp = llm.llm_engine.worker.tp
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.close()
    all_reduce = None if tp is None else "gloo" if tp.shm is None else "shared memory"
    tokens = [o.outputs[0].token_ids for o in outputs]
    return tokens, stats.num_preemptions, stats.prefix_cache.hits, all_reduce


@pytest.fixture(scope="module")
def tp1(tiny_model) -> list[list[int]]:
    tokens, num_preemptions, hits, _ = generate(tiny_model)
    assert num_preemptions > 0 and hits > 0, "the workload must preempt and hit the prefix cache"
    assert all(len(set(t)) > 10 for t in tokens), "degenerate outputs would prove little"
    return tokens


@pytest.mark.parametrize(
    ("backend", "all_reduce"), [("mp", "shared memory"), ("mp", "gloo"), ("ray", "shared memory")]
)
def test_tp2_greedy_equals_tp1_token_for_token(tiny_model, tp1, backend, all_reduce, monkeypatch):
    if all_reduce == "gloo":  # as across hosts: rank 0 (this process) offers no shared file
        monkeypatch.setattr(shm_all_reduce, "is_supported", lambda: False)
    tokens, num_preemptions, hits, used = generate(
        tiny_model, tensor_parallel_size=2, distributed_executor_backend=backend
    )
    assert used == all_reduce
    assert num_preemptions > 0 and hits > 0
    for i, (ours, reference) in enumerate(zip(tokens, tp1, strict=True)):
        assert ours == reference, f"prompt {i}: TP=2 ({backend}) departs from TP=1"


def test_a_size_that_splits_heads_is_refused_saying_what_works():
    # the default SmolLM2-135M: 9 attention heads, 3 KV heads
    with pytest.raises(ValueError, match=r"2 does not divide this model's 9 attention heads.*: 1, 3$"):
        LLM(dtype="float32", max_model_len=256, tensor_parallel_size=2)


@pytest.mark.parametrize("when", ["idle", "mid-request"])
def test_a_killed_rank_ends_the_server_with_status_1_and_the_reason(tiny_model, tmp_path, when):
    """Idle, the monitor must notice (no step runs); mid-request, rank 0's all-reduce must stop
    waiting for the dead peer. Either way the reason reaches the log."""
    log = tmp_path / "server.log"
    args = [
        "--model",
        tiny_model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--tensor-parallel-size",
        "2",
        "--disable-log-stats",
    ]
    server = ServerProcess(args, log_path=log)
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        body = {"model": tiny_model, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        children = psutil.Process(server.proc.pid).children()
        (rank_1,) = [p for p in children if "spawn_main" in " ".join(p.cmdline())]  # not the resource tracker
        if when == "idle":
            rank_1.send_signal(signal.SIGKILL)
            start = time.monotonic()
        else:
            long = {**body, "max_tokens": 240, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as stream:
                lines = stream.iter_lines()
                next(lines)  # the first tokens are out: steps are running
                rank_1.send_signal(signal.SIGKILL)
                start = time.monotonic()
                rest = "\n".join(lines)
            assert '"error"' in rest and "the engine has stopped" in rest  # an error event, not a finish
        status = server.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    assert status == 1
    assert elapsed < 10
    text = log.read_text()
    assert f"tensor-parallel rank 1 (process {rank_1.pid}) was killed by SIGKILL" in text
    assert "The engine failed (WorkerDiedError" in text
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_the_planner_reports_one_ranks_share():
    # Llama-3-8B's shape: 8 KV heads over 2 ranks leave 4 per rank, so a rank's budget holds twice the tokens
    shape = {"layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8}
    config = config_from_numbers(**shape, intermediate_size=14336, vocab_size=128256)
    budget = MemoryBudget(kv_cache_memory_bytes=8 * 2**30)
    one, two = (
        plan_capacity(config, "8B", dtype="bfloat16", budget=budget, tensor_parallel_size=n) for n in (1, 2)
    )
    assert two.kv.spec.num_kv_heads == 4
    assert two.kv.spec.bytes_per_token * 2 == one.kv.spec.bytes_per_token
    assert two.kv.num_blocks == 2 * one.kv.num_blocks
    embeddings = 2 * 128256 * 4096  # untied: embed_tokens and lm_head, whole on every rank
    assert two.num_parameters == (one.num_parameters - embeddings - 4096 - 32 * 2 * 4096) // 2 + (
        embeddings + 4096 + 32 * 2 * 4096
    )
    assert two.as_dict()["kv_cache_allocated_bytes_all_ranks"] == 2 * two.kv.allocated_bytes
    with pytest.raises(ValueError, match="3 does not divide this model's 32 attention heads"):
        plan_capacity(config, "8B", budget=budget, tensor_parallel_size=3)
