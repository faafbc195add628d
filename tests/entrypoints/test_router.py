"""The router: its policies on their own, then two real replicas behind it (hit rates on the shared
workloads against one replica alone, streaming, /metrics, a replica killed under it)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.cli.router import build_router
from pagedllm.entrypoints.router.policy import CacheAware, Replica, RoundRobin
from pagedllm.entrypoints.router.prefix_index import PrefixIndex, chunk_hashes
from pagedllm.entrypoints.router.replicas import ReplicaSet
from pagedllm.entrypoints.router.request_text import request_text
from pagedllm.entrypoints.router.stats import merge_histories
from pagedllm.workload import Conversation, load_workload

from ..helpers import RemoteServer, assert_openai_error, die_with_parent, mechanism_server_args

API_KEY = "router-key"
MODEL = "SmolLM2-135M-Instruct"
WORKLOADS = Path(__file__).parents[1] / "fixtures" / "workloads"
"""The first requests of ../shared/workloads' shared_prefix and multiturn sets, copied here: CI's
clone has no ../shared."""


# ---- policy, index, health: no servers -------------------------------------------------------------


def _replicas(n: int, chunk_chars: int = 4) -> list[Replica]:
    return [Replica(f"http://r{i}", PrefixIndex(chunk_chars, 1000)) for i in range(n)]


def test_prefix_index_matches_whole_chunks_and_evicts_leaves_first() -> None:
    index = PrefixIndex(chunk_chars=4, max_chunks=3)
    index.insert(chunk_hashes("aaaabbbbcccc", 4))
    assert index.match_chars(chunk_hashes("aaaabbbbxx", 4)) == 8
    index.insert(chunk_hashes("zzzz", 4))  # over the bound: the oldest leaf (cccc) goes, not its parents
    assert index.match_chars(chunk_hashes("aaaabbbbcccc", 4)) == 8
    assert len(index) == 3


def test_cache_aware_follows_the_prefix_until_loads_diverge() -> None:
    policy = CacheAware(cache_threshold=0.5, min_match_chars=1000, balance_abs_threshold=2)
    r0, r1 = _replicas(2)
    doc = "a shared document " * 4
    assert policy.select(doc + "q1", [r0, r1]) is r0  # cold: least loaded, first on ties
    assert policy.select("something else entirely", [r0, r1]) is r1  # ties go to the smaller index
    r0.num_in_flight = 2
    assert policy.select(doc + "q2", [r0, r1]) is r0  # 2 above the idlest is within the threshold
    r0.num_in_flight = 3
    assert policy.select(doc + "q3", [r0, r1]) is r1  # diverged: least loaded


def test_round_robin_and_request_text() -> None:
    policy = RoundRobin()
    r0, r1 = _replicas(2)
    assert [policy.select("", [r0, r1]).url for _ in range(3)] == ["http://r0", "http://r1", "http://r0"]
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"text": "U"}]}]}
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "A"}]}
    assert request_text("/v1/chat/completions", longer).startswith(request_text("/v1/chat/completions", chat))
    assert request_text("/v1/completions", {"prompt": [1, 2]}) == "[1,2]"


def test_a_down_replica_comes_back_when_its_health_probe_passes() -> None:
    replica_set = ReplicaSet(["http://r0", "http://r1"], RoundRobin())
    r0, r1 = replica_set.replicas
    r0.index.insert(chunk_hashes("abcdabcd", 4))
    replica_set.mark_down(r0, "connection refused")
    assert replica_set.healthy() == [r1] and len(r0.index) == 0
    assert replica_set.pick("", tried={"http://r1"}) is None

    async def probe(status: int) -> None:
        transport = httpx.MockTransport(lambda request: httpx.Response(status))
        async with httpx.AsyncClient(transport=transport) as client:
            await replica_set.probe_all(client)

    asyncio.run(probe(200))
    assert replica_set.healthy() == [r0, r1]
    asyncio.run(probe(503))
    assert replica_set.healthy() == []


def test_chart_samples_of_two_replicas_meet_on_shared_slots() -> None:
    def history(times: list[float], rate: float, usage: float, hit_rate: float | None) -> dict[str, list]:
        n = len(times)
        columns = {"time": times, "prompt_tokens_per_s": [rate] * n, "generation_tokens_per_s": [rate] * n}
        columns |= {"running": [1] * n, "waiting": [0] * n, "kv_cache_usage": [usage] * n}
        return columns | {"hit_rate": [hit_rate] * n, "ttft_p50": [rate] * n, "ttft_p95": [None] * n}

    # the second replica samples 0.5 s later, and has no sample in the first slot
    merged = merge_histories(
        [history([100.0, 102.0, 104.0], 1.0, 0.2, 0.5), history([102.5, 104.5], 3.0, 0.8, None)], [1, 3]
    )
    assert merged["time"] == [100.0, 102.5, 104.5]
    assert merged["generation_tokens_per_s"] == [1.0, 4.0, 4.0]
    assert merged["running"] == [1, 2, 2]
    assert merged["kv_cache_usage"] == pytest.approx([0.2, 0.65, 0.65])  # weighted by blocks, 1:3
    assert merged["hit_rate"] == [0.5, 0.5, 0.5] and merged["ttft_p50"] == [1.0, 3.0, 3.0]
    assert merged["ttft_p95"] == [None, None, None]


# ---- two real replicas ---------------------------------------------------------------------------


class UvicornThread:
    """An ASGI app served by uvicorn on a thread and a free port."""

    def __init__(self, app: FastAPI) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class RouterThread(UvicornThread):
    """`pagedllm router` flags -> the router app on a thread."""

    def __init__(self, urls: list[str], policy: str, health_interval: float = 60.0) -> None:
        argv = ["router", "--policy", policy, "--health-interval", str(health_interval)]
        super().__init__(
            build_router(build_parser().parse_args([*argv, *(f"--replica={url}" for url in urls)]))
        )

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def replica_args(mechanism_model) -> list[str]:
    """What routing is tested on: the mechanism model, whose steps cost little."""
    return [
        *mechanism_server_args(mechanism_model),
        "--kv-cache-memory-bytes",
        "512MiB",
        "--api-key",
        API_KEY,
    ]


@pytest.fixture(scope="module")
def replicas(replica_args):
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda _: RemoteServer(replica_args), range(2)))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def routers(replicas):
    urls = [server.url for server in replicas]
    started = {policy: RouterThread(urls, policy) for policy in ("cache_aware", "round_robin")}
    yield started
    for router in started.values():
        router.stop()


def _hit_rate_shared_prefix(client: openai.OpenAI, tag: str) -> float:
    """The first 8 prompts of shared_prefix.jsonl, one after another."""
    num_cached = num_prompt = 0
    for request in load_workload(WORKLOADS / "shared_prefix.jsonl", limit=8):
        out = client.completions.create(
            model=MODEL, prompt=f"[{tag}] {request.prompt}", max_tokens=4, temperature=0
        )
        num_cached += out.usage.prompt_tokens_details.cached_tokens
        num_prompt += out.usage.prompt_tokens
    return num_cached / num_prompt


def _hit_rate_multiturn(client: openai.OpenAI, tag: str) -> float:
    """2 conversations of multiturn.jsonl, each turn sent with the answers so far appended."""
    num_cached = num_prompt = 0
    for conversation in load_workload(WORKLOADS / "multiturn.jsonl", limit=2):
        assert isinstance(conversation, Conversation)
        messages = [{"role": "system", "content": f"[{tag}] {conversation.system}"}]
        for turn in conversation.turns:
            messages.append({"role": "user", "content": turn})
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
            num_cached += out.usage.prompt_tokens_details.cached_tokens
            num_prompt += out.usage.prompt_tokens
    return num_cached / num_prompt


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["shared_prefix", "multiturn"])
def test_cache_aware_keeps_a_single_replicas_hit_rate(replicas, routers, workload: str) -> None:
    # A fresh tag per run opens every prompt, so no run finds another run's blocks in a cache.
    measure = _hit_rate_shared_prefix if workload == "shared_prefix" else _hit_rate_multiturn
    single = openai.OpenAI(base_url=f"{replicas[0].url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    single_rate = measure(single, "single")
    routed_rate = measure(routers["cache_aware"].client(), "cache_aware")
    print(f"\n{workload} hit rates: single {single_rate:.3f}, cache_aware {routed_rate:.3f}")
    assert routed_rate >= 0.9 * single_rate


@pytest.mark.slow
def test_streaming_passes_through(routers) -> None:
    client = routers["cache_aware"].client()
    kwargs = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    chunks = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert len(chunks) > 1
    assert "".join(chunks) == client.completions.create(**kwargs).choices[0].text


@pytest.mark.slow
def test_models_health_and_authorization_pass_through(routers) -> None:
    url = routers["cache_aware"].url
    assert httpx.get(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401


@pytest.mark.slow
def test_metrics_aggregate_both_replicas(replicas, routers) -> None:
    text = httpx.get(f"{routers['round_robin'].url}/metrics").text
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))  # each family once, as Prometheus requires
    families = {f.name: f for f in text_string_to_metric_families(text)}
    urls = {server.url for server in replicas}
    prompt_tokens = [f for name, f in families.items() if name.endswith("prompt_tokens")]
    assert prompt_tokens and {s.labels["replica"] for s in prompt_tokens[0].samples} == urls
    healthy = families["pagedllm_router_replica_healthy"].samples
    assert {s.labels["replica"]: s.value for s in healthy} == dict.fromkeys(urls, 1.0)


def _router_process(urls: list[str], *flags: str) -> tuple[subprocess.Popen, str]:
    """`pagedllm router` as its own process (its memory measured apart from the test's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    replicas = [f"--replica={url}" for url in urls]
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "router", f"--port={port}", *flags]
    proc = subprocess.Popen([*command, *replicas], preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.2)


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


@pytest.mark.slow
def test_bodies_are_bounded_before_they_reach_a_replica(replicas) -> None:
    """A replica's 413 and 400, answered by the router without holding the body or forwarding it."""
    limit = 65536
    proc, router = _router_process([s.url for s in replicas], f"--max-request-body-bytes={limit}")
    url = f"{router}/v1/completions"
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def chunks(total: int):  # no Content-Length: counted as it streams in
        for _ in range(total >> 20):
            yield b"x" * (1 << 20)

    try:
        big = {"model": MODEL, "prompt": "Hello", "user": "u" * limit}
        assert_openai_error(httpx.post(url, json=big, headers=headers), 413, "max-request-body-bytes")
        peak = _peak_rss_mib(proc.pid)
        with contextlib.suppress(httpx.TransportError):  # the router may close before all is sent
            response = httpx.post(url, content=chunks(300 << 20), headers=headers, timeout=120)
            assert_openai_error(response, 413, "max-request-body-bytes")
        assert _peak_rss_mib(proc.pid) < peak + 50  # 300 MiB held would show
        response = httpx.post(url, content=chunks(4 << 20), headers=headers)
        assert_openai_error(response, 413, "max-request-body-bytes")
        for depth in (65, 5000):
            nested = '{"model": "m", "prompt": ' + "[" * depth + "1" + "]" * depth + "}"
            assert_openai_error(httpx.post(url, content=nested, headers=headers), 400, "nested deeper")
        assert_openai_error(httpx.get(f"{router}/no/such/path"), 404, "GET /no/such/path")
        ok = httpx.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, headers=headers)
        assert ok.status_code == 200, ok.text
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_stats_and_dashboard_merge_the_replicas(replicas, routers) -> None:
    url = routers["round_robin"].url
    auth = {"Authorization": f"Bearer {API_KEY}"}
    client = routers["round_robin"].client()
    for i in range(4):  # both replicas have finished requests to merge
        client.completions.create(model=MODEL, prompt=f"Shared opening words, then {i}", max_tokens=2)
    assert_openai_error(httpx.get(f"{url}/stats"), 401, "API key")  # the replicas' key guards it
    merged = httpx.get(f"{url}/stats", headers=auth).json()
    own = merged.pop("replicas")
    assert set(own) == {server.url for server in replicas}
    snapshots = list(own.values())
    assert set(merged) == set(snapshots[0])  # the replica's shape: its dashboard page reads it
    for name in ("finished", "running", "generation_tokens", "prompt_tokens_computed"):
        assert merged[name] == sum(s[name] for s in snapshots)
    assert all(s["finished"] > 0 for s in snapshots)
    cache = merged["prefix_cache"]
    for name in ("requests", "queries", "hits"):
        assert cache[name] == sum(s["prefix_cache"][name] for s in snapshots)
    assert cache["hit_rate"] == pytest.approx(cache["hits"] / cache["queries"])
    assert merged["kv_cache"]["num_blocks"] == sum(s["kv_cache"]["num_blocks"] for s in snapshots)
    assert len({len(column) for column in merged["history"].values()}) == 1

    blocks = httpx.get(f"{url}/stats/kv_blocks", headers=auth).json()
    assert blocks["num_blocks"] == len(blocks["states"]) == merged["kv_cache"]["num_blocks"]
    first_of_second = snapshots[0]["kv_cache"]["num_blocks"]
    block = httpx.get(f"{url}/stats/kv_blocks/{first_of_second}", headers=auth).json()
    assert block["block_id"] == first_of_second
    past_the_end = httpx.get(f"{url}/stats/kv_blocks/{blocks['num_blocks']}", headers=auth)
    assert_openai_error(past_the_end, 404, "block")

    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and 'fetch("stats"' in page.text
    assert httpx.get(f"{url}/static/uPlot.iife.min.js").status_code == 200


def _breaking_replica() -> FastAPI:
    """A stand-in replica whose stream breaks after its first event."""
    app = FastAPI()

    @app.get("/health")
    def health() -> Response:
        return Response()

    @app.post("/v1/completions")
    def completions() -> StreamingResponse:
        def events():
            yield b'data: {"choices": []}\n\n'
            raise RuntimeError("the replica died mid-stream")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_stream_broken_mid_way_ends_with_an_error_event() -> None:
    replica = UvicornThread(_breaking_replica())
    router = RouterThread([replica.url], "cache_aware")
    try:
        with httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
            body = r.read().decode()
    finally:
        router.stop()
        replica.stop()
    assert body.startswith('data: {"choices": []}')
    assert '"error"' in body and body.endswith("data: [DONE]\n\n")


@pytest.mark.slow
def test_a_killed_replica_is_taken_out_without_client_errors(replicas, replica_args) -> None:
    """A replica of its own is killed, behind routers of their own: the module's replicas and routers
    stay whole for the other tests, in any order. The health interval is 60 s, so requests find the
    failure."""
    doomed = RemoteServer(replica_args)
    urls = [replicas[0].url, doomed.url]
    routers = {policy: RouterThread(urls, policy) for policy in ("cache_aware", "round_robin")}
    try:
        doomed.stop()
        for router in routers.values():
            client = router.client()
            for i in range(3):
                out = client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=2)
                assert out.choices[0].text is not None
        text = httpx.get(f"{routers['round_robin'].url}/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = families["pagedllm_router_replica_healthy"].samples
        assert {s.labels["replica"]: s.value for s in samples} == {urls[0]: 1.0, urls[1]: 0.0}
        samples = families["pagedllm_router_replica_failures"].samples
        assert {s.labels["replica"]: s.value for s in samples}[urls[1]] >= 1
        assert httpx.get(f"{routers['round_robin'].url}/health").status_code == 200
    finally:
        for router in routers.values():
            router.stop()
        doomed.stop()
