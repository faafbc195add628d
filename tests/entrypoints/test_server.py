"""The OpenAI-compatible server, end to end: a real uvicorn process on a free port, driven with the
official `openai` client (sync and async, streaming and not) and httpx, checked against the
offline LLM with the same engine settings."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import SamplingParams

from ..helpers import API_KEY, MODEL, SHARED_MAX_NUM_SEQS, SHARED_MAX_QUEUE_LEN, TEST_ENGINE_ARGS

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Water boils at",
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def read_metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels other than model_name): value}."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# ---- the basics ------------------------------------------------------------------------------------


def test_models_health_version(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == TEST_ENGINE_ARGS["max_model_len"]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_greedy_completions_equal_offline_generate(client, llm):
    expected = llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    for prompt, reference in zip(PROMPTS[:2], expected, strict=False):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        choice = response.choices[0]
        assert choice.text == reference.outputs[0].text
        assert choice.finish_reason == reference.outputs[0].finish_reason
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert response.usage.completion_tokens == len(reference.outputs[0].token_ids)
        cached = response.usage.prompt_tokens_details.cached_tokens
        # whole 16-token blocks (the default block size), and never the last prompt token
        assert cached % 16 == 0 and 0 <= cached < response.usage.prompt_tokens
    # Every prompt in one request: choices come back in prompt order.
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in response.choices] == [r.outputs[0].text for r in expected]
    assert response.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)
    # A prompt given as token ids.
    token_prompt = list(expected[2].prompt_token_ids)
    response = client.completions.create(model=MODEL, prompt=token_prompt, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected[2].outputs[0].text


def test_stop_strings_equal_offline(client, llm):
    params = greedy(40, stop=["\n", "."], include_stop_str_in_output=True)
    expected = llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0]
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        max_tokens=40,
        temperature=0,
        stop=["\n", "."],
        extra_body={"include_stop_str_in_output": True},
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason == "stop"


def test_greedy_chat_equals_offline_chat(client, llm):
    conversations = [
        [{"role": "user", "content": "Hi! Who are you?"}],
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of Italy?"},
        ],
    ]
    expected = llm.chat(conversations, greedy(16), use_tqdm=False)
    for messages, reference in zip(conversations, expected, strict=True):
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0
        )
        choice = response.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == reference.outputs[0].text
        assert choice.finish_reason == reference.outputs[0].finish_reason
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    # Content as a list of text parts is the same conversation.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi! Who are you?"}]}]
    response = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, temperature=0)
    assert response.choices[0].message.content == expected[0].outputs[0].text


# ---- streaming and concurrency -------------------------------------------------------------------


@pytest.mark.slow  # 32 streams; the fast set keeps streamed against non-streamed for one
def test_32_concurrent_streams_finish_and_equal_non_streamed(server, llm):
    prompts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(32)]
    expected = llm.generate(prompts, greedy(8), use_tqdm=False)

    async def run() -> tuple[list[tuple[str, str, object]], list[str]]:
        client = async_client(server)

        async def streamed(prompt: str) -> tuple[str, str, object]:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, finish_reason, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish_reason = chunk.choices[0].finish_reason or finish_reason
                usage = chunk.usage or usage
            return text, finish_reason, usage

        async def whole(prompt: str) -> str:
            response = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0
            )
            return response.choices[0].text

        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        wholes = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return streams, wholes

    streams, wholes = asyncio.run(run())
    for (text, finish_reason, usage), whole, reference in zip(streams, wholes, expected, strict=True):
        assert text == whole == reference.outputs[0].text
        assert finish_reason == reference.outputs[0].finish_reason
        assert usage.completion_tokens == len(reference.outputs[0].token_ids)
        assert usage.prompt_tokens == len(reference.prompt_token_ids)


def test_chat_stream_sends_role_then_content_then_usage(server, client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)

    async def run():
        async with async_client(server) as aclient:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=20,
                temperature=0,
                stream=True,
                extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with_usage = [c for c in chunks[1:-1] if c.choices]
    assert all(c.usage is not None for c in with_usage)  # continuous_usage_stats
    assert with_usage[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_cached_tokens_reported_for_a_repeated_prompt(client):
    prompt = "Here is a long shared document about paged attention. " * 30 + "Summary:"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 300
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert second.choices[0].text == first.choices[0].text
    # cache_salt reaches the engine: a salted request shares nothing with unsalted ones.
    salted = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-a"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_timings_split_each_request_and_keep_the_openai_client_working(client):
    """`timings` (llama.cpp's names): counts that add up to usage, times that add up to the
    request's; in a whole response and in the last chunk of a stream."""
    prompt = "Timings of a long shared document. " * 20 + "Summary:"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    second = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0
    )
    repeat = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    for reply in (first, second, repeat):
        t = reply.model_extra["timings"]
        assert t["prompt_n"] + t["cache_n"] == reply.usage.prompt_tokens
        assert t["cache_n"] == reply.usage.prompt_tokens_details.cached_tokens
        assert t["predicted_n"] == reply.usage.completion_tokens
        assert t["queue_ms"] >= 0 and t["prompt_ms"] > 0 and t["predicted_ms"] > 0
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / (t["predicted_n"] - 1))
    assert repeat.model_extra["timings"]["cache_n"] > 0 == first.model_extra["timings"]["cache_n"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    ended = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ended) == 1 and ended[0].model_extra["timings"]["predicted_n"] == 5
    assert all("timings" not in (c.model_extra or {}) for c in chunks if c not in ended)


def test_n_choices_are_seeded_like_offline(client, llm):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12)
    expected = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], n=3, temperature=0.8, seed=7, max_tokens=12
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [c.text for c in expected]
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, temperature=0.8, seed=3, max_tokens=8
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_logprobs_in_openai_shapes(client, llm):
    reference = llm.generate(PROMPTS[0], greedy(6, logprobs=2), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    for position, (token_id, entry) in enumerate(zip(reference.token_ids, reference.logprobs, strict=True)):
        assert logprobs.token_logprobs[position] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert len(logprobs.top_logprobs[position]) == 2  # greedy: the sampled token is the top one
    assert logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob

    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    streamed = [t for chunk in stream for t in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs)


# ---- failure ---------------------------------------------------------------------------------------


def _assert_idle_soon(http: httpx.Client) -> dict:
    """The server's metrics once nothing runs and no KV block is held. The wait is bounded by what
    only a leak misses (a request that is never freed), not by how fast a busy host frees it."""
    dropped = time.monotonic()
    while True:
        metrics = read_metrics(http)
        running = metrics[("pagedllm:num_requests_running", ())]
        usage = metrics[("pagedllm:kv_cache_usage_perc", ())]
        if running == 0 and usage == 0.0:  # cached-but-free blocks count as free
            return metrics
        assert time.monotonic() - dropped < 30, f"still running {running}, KV usage {usage} after 30 s"
        time.sleep(0.05)


def test_dropped_client_frees_its_request(server, http):
    aborts = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
    before = read_metrics(http).get(aborts, 0)
    body = {"model": MODEL, "prompt": "Count slowly: one, two,", "max_tokens": 600, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert len(received) >= 2
        assert read_metrics(http)[("pagedllm:num_requests_running", ())] == 1
    assert _assert_idle_soon(http)[aborts] == before + 1
    # A non-streaming client that gives up is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.0)
    assert _assert_idle_soon(http)[aborts] == before + 2


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 2}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt_token_ids"),
    ({"prompt": "word " * 1100}, "prompt"),
    ({"prompt": "hi", "max_tokens": 1024}, "max_tokens"),
    ({"max_tokens": 4}, "prompt"),
]


def test_every_error_is_openai_shaped_and_others_are_undisturbed(server, http, llm):
    expected = llm.generate(PROMPTS[4], greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text

    async def stream_alongside() -> str:
        async with async_client(server) as aclient:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=PROMPTS[4],
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

    result: dict[str, str] = {}
    thread = threading.Thread(target=lambda: result.update(text=asyncio.run(stream_alongside())))
    thread.start()

    url = "/v1/completions"
    for body, param in BAD_COMPLETIONS:
        _assert_openai_error(http.post(url, json={"model": MODEL, **body}), 400, param)
    _assert_openai_error(
        http.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    bad_chat = [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "word " * 1100}]}, "prompt"),
    ]
    for body, param in bad_chat:
        _assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, **body}), 400, param)
    error = _assert_openai_error(http.post(url, json={"model": "gpt-4", "prompt": "hi"}), 404, "model")
    assert error["code"] == "model_not_found"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}{url}", json={"model": MODEL, "prompt": "hi"}, headers=headers)
        assert _assert_openai_error(response, 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1 needs the key
    _assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")

    thread.join(120)
    assert result["text"] == expected
    assert http.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_full_queue_gets_503_with_retry_after(server, http):
    async def run() -> tuple[list[int], list[str]]:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
        ) as aclient:
            # Every seat taken for longer than the test lasts; 8 x 600 tokens fit the pool, so no preemption.
            long = {"model": MODEL, "max_tokens": 600, "ignore_eos": True, "stream": True}
            holders = []
            for i in range(SHARED_MAX_NUM_SEQS):
                request = aclient.build_request(
                    "POST", "/v1/completions", json={**long, "prompt": f"Seat {i}:"}
                )
                response = await aclient.send(request, stream=True)
                holders.append((response, response.aiter_lines()))
            for _, lines in holders:
                await anext(lines)
            short = {"model": MODEL, "max_tokens": 1}
            queued = [
                asyncio.ensure_future(aclient.post("/v1/completions", json={**short, "prompt": f"Wait {i}"}))
                for i in range(SHARED_MAX_QUEUE_LEN + 8)
            ]
            deadline = time.monotonic() + 60
            rejected: list[asyncio.Future] = []
            while len(rejected) < 8 and time.monotonic() < deadline:  # refused while the seats stay taken
                await asyncio.sleep(0.05)
                rejected = [task for task in queued if task.done() and task.result().status_code == 503]
            for response, _ in holders:
                await response.aclose()
            statuses = [(await task).status_code for task in queued]
            retry_after = [task.result().headers.get("retry-after") for task in rejected]
            return statuses, retry_after

    statuses, retry_after = asyncio.run(run())
    assert statuses.count(503) == 8 and statuses.count(200) == SHARED_MAX_QUEUE_LEN
    assert all(value is not None and int(value) >= 1 for value in retry_after)


def test_metrics_parse_and_counters_move(client, http, llm):
    before = read_metrics(http)
    client.completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = read_metrics(http)
    prefix = "pagedllm:"
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (prefix + name, ()) in after
    length = ("pagedllm:request_success_total", (("finished_reason", "length"),))
    assert after[length] == before.get(length, 0) + 1
    assert (
        after[("pagedllm:generation_tokens_total", ())]
        >= before[("pagedllm:generation_tokens_total", ())] + 5
    )
    assert after[("pagedllm:prompt_tokens_total", ())] > before[("pagedllm:prompt_tokens_total", ())]
    assert (
        after[("pagedllm:prefix_cache_queries_total", ())]
        > before[("pagedllm:prefix_cache_queries_total", ())]
    )
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        key = (f"{prefix}{name}_count", ())
        assert after[key] == before[key] + 1, name
    itl = ("pagedllm:inter_token_latency_seconds_count", ())
    assert after[itl] >= before[itl] + 4
    info = next(labels for (name, labels) in after if name == "pagedllm:cache_config_info")
    assert dict(info) == {
        "block_size": "16",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "num_gpu_blocks": str(llm.llm_engine.facts.num_kv_blocks),  # same engine settings
    }
    assert ("pagedllm:prefix_cache_hits_total", ()) in after and (
        "pagedllm:num_preemptions_total",
        (),
    ) in after


def test_stats_and_dashboard(server, client, http, llm):
    before = http.get("/stats").json()
    client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=3, temperature=0, user="dashboard-user"
    )
    after = http.get("/stats").json()
    assert after["finished"] == before["finished"] + 1
    assert after["kv_cache"]["num_blocks"] == llm.llm_engine.facts.num_kv_blocks  # same engine settings
    caller = after["prefix_cache"]["by_user"]["dashboard-user"]
    assert caller["requests"] == 1 and caller["queries"] > 0
    for phase in ("queue_time", "prefill_time", "decode_time", "time_to_first_token", "e2e_latency"):
        q = after["latency_s"][phase]
        assert 0 <= q["p50"] <= q["p95"] <= q["p99"], phase
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("stats"' in page.text
    assert httpx.get(f"{server.url}/stats").status_code == 401  # it names callers: guarded like /v1


def test_stats_name_where_prompts_stop_sharing(client, http):
    rules = "Answer briefly and cite sources. " * 12
    for second in (7, 9, 11):
        client.completions.create(
            model=MODEL, prompt=f"Support bot. Time: 10:41:{second:02d}\n{rules}Q: hi", max_tokens=1
        )
    [group] = [g for g in http.get("/stats").json()["prefix_divergence"] if "10:41:" in g["variants"][0]]
    assert group["requests"] == 2 and group["shares_again_tokens"] > 40
    assert group["recoverable_tokens"] % 16 == 0 and group["recoverable_tokens"] >= 32


def test_tokenize_and_detokenize(http, llm):
    tokenizer = llm.get_tokenizer()
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokens["tokens"] == tokenizer(PROMPTS[0]).input_ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == TEST_ENGINE_ARGS["max_model_len"]
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[0]}
    messages = [{"role": "user", "content": "Hi"}]
    chat_tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat_tokens == llm.chat(messages, greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert json.loads(http.post("/tokenize", json={}).text)["error"]["param"] == "prompt"
