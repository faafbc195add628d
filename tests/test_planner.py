"""`pagedllm plan`: its arithmetic is the engine's (exact blocks for the same model and budget),
it reads only configs (HF config.json or GGUF metadata), and the classic 7B example checks by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm import LLM
from pagedllm.entrypoints.cli.main import main
from pagedllm.model.config_reader import model_config_from_dict
from pagedllm.model.gguf_convert import converted_folder, gguf_hf_config
from pagedllm.model.locate import default_model_path
from pagedllm.planner import MemoryBudget, plan_capacity, read_model_config

from .helpers import TEST_ENGINE_ARGS

LLAMA_7B_SHAPE = {
    "layers": 32,
    "hidden-size": 4096,
    "num-heads": 32,
    "num-kv-heads": 32,
    "intermediate-size": 11008,
    "vocab-size": 32000,
    "dtype": "float16",
}
LLAMA_7B = [arg for flag, value in LLAMA_7B_SHAPE.items() for arg in (f"--{flag}", str(value))]


def plan_json(capsys, *argv: str) -> dict:
    main(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_7b_by_numbers_checks_by_hand(capsys):
    on_24gb = ["--device-memory", "24GB", "--gpu-memory-utilization", "0.9", "--max-model-len", "2048"]
    plan = plan_json(capsys, *LLAMA_7B, *on_24gb, "--overhead-bytes", "0.5GB")
    assert plan["bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288  # 0.5 MiB per token in fp16
    assert plan["num_parameters"] == 6_738_415_616  # Llama 2 7B
    assert plan["weights_bytes"] == 2 * 6_738_415_616  # ~13.5 GB: "~14 GB of weights"
    assert plan["kv_cache_memory_bytes"] == 21_600_000_000 - 13_476_831_232 - 500_000_000  # ~7.6 GB
    assert plan["num_blocks"] == 7_623_168_768 // (524_288 * 16) == 908
    assert plan["kv_cache_tokens"] == 14_528  # ~14,500 tokens
    assert 6 <= plan["max_concurrency"] < 8  # 7.09: "6-7 requests of 2,048 tokens"
    by_len = {(p["max_model_len"], p["kv_cache_dtype"]): p for p in plan["what_if"]}
    assert 3 <= by_len[4096, "float16"]["max_concurrency"] < 4  # 3.55: "3-4 of 4,096"
    int8 = by_len[4096, "int8"]
    assert int8["bytes_per_token"] == 2 * 32 * 32 * (128 + 2) and int8["scale_bytes_per_token"] == 4096
    assert int8["num_blocks"] / by_len[4096, "float16"]["num_blocks"] >= 1.9
    # Without the overhead: the whole 21.6 GB less weights
    assert plan_json(capsys, *LLAMA_7B, *on_24gb)["kv_cache_tokens"] == 15_488


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_planner_blocks_equal_what_the_engine_allocates(llm, kv_cache_dtype):
    engine_llm = llm if kv_cache_dtype == "auto" else LLM(**TEST_ENGINE_ARGS, kv_cache_dtype=kv_cache_dtype)
    engine = engine_llm.llm_engine
    plan = plan_capacity(
        read_model_config(None),
        "default",
        dtype=TEST_ENGINE_ARGS["dtype"],
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=TEST_ENGINE_ARGS["max_model_len"],
        budget=MemoryBudget(kv_cache_memory_bytes=256 * 2**20),
    )
    assert plan.kv.num_blocks == engine.facts.num_kv_blocks
    assert plan.kv.num_tokens == engine.facts.kv_cache_plan.num_tokens
    assert plan.kv.max_concurrency == engine.facts.kv_cache_plan.max_concurrency
    assert plan.weights_bytes == engine.core.worker.weights_bytes
    # ... and the tensors really have that many blocks and bytes, scales included
    caches = engine.core.worker.runner.kv_caches
    assert all(k.shape[0] == v.shape[0] == plan.kv.num_blocks for k, v in caches)
    allocated = sum(k.nbytes + v.nbytes for k, v in caches)
    assert allocated == plan.kv.num_tokens * plan.kv.spec.bytes_per_token == plan.kv.allocated_bytes


@pytest.mark.slow  # converts the GGUF once more
def test_gguf_metadata_gives_the_converted_config(tmp_path, monkeypatch):
    path = default_model_path()
    converted = json.loads((converted_folder(path) / "config.json").read_text())
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))  # no cached conversion: metadata only
    assert gguf_hf_config(path) == converted
    assert not any(tmp_path.iterdir())  # nothing was converted
    assert model_config_from_dict(converted) == read_model_config(str(path))


@pytest.mark.slow  # a process of its own; the fast set keeps the report in-process
def test_python_m_pagedllm_plan_prints_the_report_and_what_if_table():
    # --dtype pinned: `auto` is bfloat16 on CPUs with bfloat16 hardware, float32 elsewhere
    argv = [
        "plan",
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "int8",
        "--kv-cache-memory-bytes",
        "256MiB",
        "--max-model-len",
        "1024",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm", *argv], capture_output=True, text=True, check=True
    ).stdout
    assert "30 layers, 9 heads, 3 KV heads, head_dim 64" in out
    assert "bytes per token  11,880 = 2 x 30 layers x 3 KV heads x (64 x 1 byte + 2 scale bytes)" in out
    assert "blocks           1,412 of 16 tokens" in out and "tokens           22,592" in out
    assert "max concurrency  22.06 requests of 1,024 tokens" in out
    table = out[out.index("what if") :].splitlines()
    assert [line.split()[0] for line in table[3:]] == ["1,024", "2,048", "4,096", "8,192"]
    assert table[-1].split()[1:] == ["does", "not", "fit", "2.76", "2.76"]  # float32 at 8,192 tokens


def test_plan_errors_say_what_to_change(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--layers", "32", "--hidden-size", "4096"])
    assert "--num-heads, --intermediate-size, --vocab-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", *LLAMA_7B, "--device-memory", "12GB"])
    assert "no memory left for the KV cache" in capsys.readouterr().err


def test_sliding_windows_are_the_layers_own_and_max_model_len_is_refused_over_the_context():
    """Windows as transformers applies them (so they do not cap the context): Mistral's on every
    layer, Qwen2's from max_window_layers on and only with use_sliding_window, Llama's never."""
    config = json.loads((converted_folder(default_model_path()) / "config.json").read_text())
    config |= {"max_position_embeddings": 4096, "sliding_window": 512, "num_hidden_layers": 4}
    mistral = model_config_from_dict({**config, "architectures": ["MistralForCausalLM"]})
    assert mistral.layer_windows == (512,) * 4
    assert model_config_from_dict({**config, "architectures": ["LlamaForCausalLM"]}).layer_windows is None
    qwen2 = {**config, "architectures": ["Qwen2ForCausalLM"], "max_window_layers": 1}
    assert model_config_from_dict(qwen2).layer_windows is None  # use_sliding_window is off by default
    assert model_config_from_dict(qwen2 | {"use_sliding_window": True}).layer_windows == (None, 512, 512, 512)
    assert mistral.resolve_max_model_len(None) == 4096
    assert mistral.resolve_max_model_len(1000) == 1000
    with pytest.raises(ValueError, match="max_model_len: 5,000 is over the model's context of 4,096"):
        mistral.resolve_max_model_len(5000)
    plan = plan_capacity(mistral, model_name="windowed", max_model_len=1000)
    assert plan.kv.max_model_len == 1000  # the planner serves what the engine would
