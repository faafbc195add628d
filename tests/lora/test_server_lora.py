"""LoRA through the OpenAI-compatible server (vLLM's flags and routes): a request names its adapter
in `model` and gets the offline engine's output under it (tests/lora/test_lora_generation.py
checks that against transformers + PEFT); /v1/models lists the adapters with their parent;
adapters are loaded and unloaded while requests stream, none failing; bad adapters and unknown
names get vLLM's 4xx; /metrics has lora_requests_info and /stats the hit rate by adapter."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from pagedllm import LLM, LoRARequest, SamplingParams

from ..helpers import RemoteServer
from .helpers import base_model, random_adapter

pytestmark = pytest.mark.slow  # servers of their own

PROMPT = [5, 17, 300, 42, 9, 11] * 6  # 36 tokens: two full blocks
NEW_TOKENS = 8
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "64MiB"]
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = root / "base"
    base_model("qwen3", base)
    adapters = {
        name: random_adapter(base, root / name, rank, seed)
        for name, rank, seed in (("alpha", 8, 21), ("beta", 16, 22), ("gamma", 8, 23), ("high", 128, 24))
    }
    return base, adapters


@pytest.fixture(scope="module")
def server(files):
    base, adapters = files
    modules = [f"alpha={adapters['alpha']}", json.dumps({"name": "beta", "path": str(adapters["beta"])})]
    server = RemoteServer(
        ["--model", str(base), *ENGINE, *LORA, "--lora-modules", *modules, "--allow-runtime-lora-updating"],
        env={"PAGEDLLM_API_KEY": ""},
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(files):
    """The offline engine's greedy text under each adapter (and the base model: None)."""
    base, adapters = files
    llm = LLM(
        str(base),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes="64MiB",
        enable_lora=True,
        max_lora_rank=64,
        disable_log_stats=True,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    texts = {}
    for index, name in enumerate([None, "alpha", "beta", "gamma"]):
        adapter = LoRARequest(name, index, str(adapters[name])) if name else None
        output = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=adapter)
        texts[name] = output[0].outputs[0].text
    llm.shutdown()
    return texts


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(server, model: str) -> openai.types.Completion:
    return client(server).completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_models_lists_the_adapters_with_their_parent(server, files):
    _, adapters = files
    cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
    base_name = next(name for name, card in cards.items() if card["parent"] is None)
    assert cards["alpha"]["parent"] == cards["beta"]["parent"] == base_name
    assert cards["alpha"]["root"] == str(adapters["alpha"])


def test_a_request_runs_under_the_adapter_its_model_names(server, offline):
    base_name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    assert complete(server, base_name).choices[0].text == offline[None]
    for name in ("alpha", "beta"):
        response = complete(server, name)
        assert response.model == name
        assert response.choices[0].text == offline[name], name
    assert offline["alpha"] != offline[None] != offline["beta"]


def test_unknown_adapters_and_bad_loads_get_vllms_errors(server, files):
    _, adapters = files
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(server, "nope")
    already = post(
        server, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["gamma"])}
    )
    assert already.status_code == 400 and "already been loaded" in already.json()["error"]["message"]
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere/at/all"})
    assert missing.status_code == 404
    high = post(server, "/v1/load_lora_adapter", {"lora_name": "high", "lora_path": str(adapters["high"])})
    assert high.status_code == 400 and "--max-lora-rank" in high.json()["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code in (400, 422)
    assert complete(server, "alpha").choices[0].finish_reason == "length", "the server serves on"


def stream(server, model: str, started: threading.Semaphore) -> str:
    """A streamed completion's text; `started` is released at its first chunk (the request is in
    the engine then, so an unload after it must not fail it)."""
    chunks = client(server).completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    text = ""
    for index, chunk in enumerate(chunks):
        if index == 0:
            started.release()
        text += "".join(choice.text for choice in chunk.choices)
    return text


def test_loading_and_unloading_under_load_fails_no_request(server, files, offline):
    _, adapters = files
    names = ("alpha", "beta") * 4
    started = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(len(names) + 3) as pool:
        running = [pool.submit(stream, server, name, started) for name in names]
        for _ in names:  # every request in the engine before its adapter goes
            assert started.acquire(timeout=120), "a streamed request never started"
        loaded = post(
            server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
        )
        assert loaded.status_code == 200 and "gamma" in loaded.text
        with_gamma = [pool.submit(complete, server, "gamma") for _ in range(3)]
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
        for future, name in zip(running, names, strict=True):
            assert future.result() == offline[name]
        for future in with_gamma:
            assert future.result().choices[0].text == offline["gamma"]
    with pytest.raises(openai.NotFoundError):
        complete(server, "beta")
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["beta"])})
    assert again.status_code == 200 and complete(server, "beta").choices[0].text == offline["beta"]


def test_metrics_and_stats_name_the_adapters(server):
    complete(server, "alpha")
    metrics = httpx.get(f"{server.url}/metrics").text
    info = [line for line in metrics.splitlines() if line.startswith("pagedllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and "running_lora_adapters=" in info[0]
    assert 'pagedllm:prefix_cache_queries_by_adapter_total{adapter="alpha"' in metrics
    by_adapter = httpx.get(f"{server.url}/stats").json()["prefix_cache"]["by_adapter"]
    assert by_adapter["alpha"]["requests"] >= 2 and by_adapter["alpha"]["hits"] > 0


def test_the_runtime_routes_need_the_switch(files):
    base, adapters = files
    env = {"PAGEDLLM_API_KEY": "", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": ""}
    server = RemoteServer(
        ["--model", str(base), *ENGINE, *LORA, "--lora-modules", f"alpha={adapters['alpha']}"], env=env
    )
    try:
        body = {"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
        assert post(server, "/v1/load_lora_adapter", body).status_code == 404
        assert complete(server, "alpha").choices[0].finish_reason == "length"
    finally:
        server.stop()


def test_a_bad_adapter_at_start_up_is_a_clear_exit(files, tmp_path):
    base, _ = files
    command = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", str(base), *ENGINE]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *args, "--port", "0"], capture_output=True, text=True, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start-ups at once
        bad = pool.submit(run, *LORA, "--lora-modules", f"bad={tmp_path}/nowhere")
        off = pool.submit(run, "--lora-modules", f"bad={tmp_path}")
        assert bad.result().returncode != 0 and "--lora-modules" in bad.result().stderr
        assert "no such adapter" in bad.result().stderr
        assert off.result().returncode != 0 and "--enable-lora" in off.result().stderr
