"""One request must never harm anyone but its sender. Every request that once stopped or stalled a
pagedllm server (issues 10 and 21) is sent to a real server while another client streams: each gets
an OpenAI-shaped 4xx (never a 500, never an error as large as the body), the stream finishes whole,
and the server goes on serving; a long chat history costs bounded work on the shared tokenizer
thread. Then faults are injected inside single requests (their sampling, their detokenization: the
others finish with the output they would have had) and inside the batch's forward pass (the server
exits 1, saying why).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from pagedllm.entrypoints.openai import chat_history
from pagedllm.entrypoints.openai.protocol import ChatMessage

from ..fault_server import DETOKENIZE_FAULT_SEED, FORWARD_FAULT_TOKEN, SAMPLING_FAULT_SEED
from ..helpers import (
    API_KEY,
    SHARED_MAX_QUEUE_LEN,
    TEST_ENGINE_ARGS,
    RemoteServer,
    assert_openai_error,
    shared_server_args,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = "Hello " * 20  # over one 16-token block, so a cache salt is hashed
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}
HUGE_TEXT = "All work and no play. " * 9_000  # ~200 KB: under the body bound, far over max_model_len


def with_reply(reply: dict) -> list[dict]:
    """A conversation whose earlier assistant turn is `reply`."""
    return [*CHAT, {"role": "assistant", **reply}, {"role": "user", "content": "and?"}]


# (path, body as sent, status, what the error names: its param, else a piece of its message)
BAD_REQUESTS = [
    (
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1000000]},
        400,
        "stop_token_ids",
    ),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 4, "seed": 18446744073709551616}', 400, "seed"),
    (
        "/v1/completions",
        '{"prompt": "Hello", "max_tokens": 4, "top_k": 1000000000000000000000000000000, "top_p": 0.9}',
        400,
        "top_k",
    ),
    (
        "/v1/completions",
        json.dumps({"prompt": LONG_PROMPT, "max_tokens": 4}).replace("}", ', "cache_salt": "\\ud800"}'),
        400,
        "cache_salt",
    ),
    ("/v1/completions", '{"prompt": "Hello there", "max_tokens": 2, "user": "\\ud800"}', 400, "user"),
    ("/v1/completions", '{"prompt": "Hello \\ud800", "max_tokens": 2}', 400, "prompt"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2}',
        400,
        "messages",
    ),
    ("/tokenize", '{"prompt": "Hello \\ud800"}', 400, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}},
        400,
        "chat_template",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1 / 0 }}"}, 400, "chat_template"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
        400,
        "chat_template_kwargs",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
        400,
        "chat_template_kwargs",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"conversation": []}},
        400,
        "chat_template_kwargs",
    ),
    ("/v1/completions", '{"prompt": ' + "[" * 600 + "1" + "]" * 600 + "}", 400, "nested deeper"),
    ("/v1/completions", '{"prompt": ' + "[" * 5000 + "1" + "]" * 5000 + "}", 400, "nested deeper"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "Hello", "user": "u" * 1_000_000}, 413, "max-request-body-bytes"),
    ("/v1/completions", {"prompt": "Hello", "user": "u" * 1000}, 400, "user"),
    ("/v1/completions", {"prompt": "Hello", "n": 1_000_000}, 400, "n"),
    ("/v1/completions", {"prompt": "Hello", "n": SHARED_MAX_QUEUE_LEN + 1}, 400, "n"),
    ("/v1/completions", {"prompt": "Hello", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "Hello", "echo": True}, 400, "echo"),
    (
        "/v1/completions",
        {"prompt": "Hello", "structured_outputs": {"regex": "(" * 5000}},
        400,
        "structured_outputs.regex",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]},
        400,
        "tools",
    ),
    ("/v1/completions", {"prompt": "Hello", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hello", "logit_bias": {"12": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hello", "temperature": "NaN"}, 400, "temperature"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, 400, "prompt_token_ids"),
    ("/detokenize", {"tokens": [10**12]}, 400, "tokens"),
    # issue 21: shapes that reached the code unchecked (500s), refused fields, sizes bounded up front
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}},
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [TOOL], "tool_choice": ["auto"]},
        400,
        "tool_choice",
    ),
    ("/v1/chat/completions", {"messages": with_reply({"tool_calls": 5})}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": with_reply({"tool_calls": [{"id": "c", "function": "f"}]})},
        400,
        "messages.1.tool_calls.0.function",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5000}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": HUGE_TEXT}, *CHAT], "max_tokens": 4},
        400,
        "messages",
    ),
    ("/v1/completions", {"prompt": HUGE_TEXT, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "stop": ["x" * 1000] * 65}, 400, "stop"),
]


def send(url: str, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    headers = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120)


class Stream:
    """A greedy completion streamed on a thread of its own: the victim the bad requests must not hurt."""

    def __init__(self, url: str, max_tokens: int = 200) -> None:
        self.body = {
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        self.url, self.text, self.finish_reason, self.errors = url, "", None, []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60)

    def _run(self) -> None:
        with httpx.stream(
            "POST",
            f"{self.url}/v1/completions",
            json={**self.body, "stream": True},
            headers=AUTH,
            timeout=300,
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    self.errors.append(chunk)
                    continue
                self.started.set()
                self.text += chunk["choices"][0]["text"]
                self.finish_reason = chunk["choices"][0]["finish_reason"] or self.finish_reason
        self.started.set()

    def join(self) -> None:
        self.thread.join(300)
        assert not self.thread.is_alive()


@pytest.mark.parametrize(("path", "body", "status", "names"), BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_a_bad_request_gets_an_openai_shaped_error(server, path, body, status, names):
    assert_openai_error(send(server.url, path, body), status, names)


@pytest.mark.slow  # a 200-token stream beside every bad request
def test_no_bad_request_harms_a_concurrent_stream_or_the_server(server):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    alone = send(server.url, "/v1/completions", body).json()
    metrics_before = httpx.get(f"{server.url}/metrics").text
    victim = Stream(server.url)
    for path, body, status, names in BAD_REQUESTS:
        response = send(server.url, path, body)
        assert_openai_error(response, status, names)
        assert len(response.content) < 2_000  # a bad value is quoted in part, never whole
    victim.join()
    assert not victim.errors and victim.finish_reason == "length"
    assert victim.text == alone["choices"][0]["text"]  # the very tokens it gets alone
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and len(metrics.text) < 2 * len(metrics_before)
    stats = httpx.get(f"{server.url}/stats", headers=AUTH)
    assert stats.status_code == 200
    kv_cache = stats.json()["kv_cache"]
    assert kv_cache["free_blocks"] == kv_cache["num_blocks"]  # nothing held once all is done


def test_errors_outside_the_api_are_openai_shaped_and_the_key_guards_tokenization(server):
    url = server.url
    assert_openai_error(httpx.get(f"{url}/no/such/path"), 404, "GET /no/such/path")
    assert_openai_error(httpx.get(f"{url}/v1/completions", headers=AUTH), 405, "GET /v1/completions")
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(httpx.post(f"{url}{path}", json=body), 401, "API key")
        assert httpx.post(f"{url}{path}", json=body, headers=AUTH).status_code == 200
    lower = {"Authorization": f"bearer {API_KEY}"}  # RFC 7235: the scheme is case-insensitive
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers=lower).status_code == 200
    assert_openai_error(
        httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Basic x"}),
        401,
        "API key",
    )
    # a chunked body (no Content-Length) is cut off at the bound as well
    chunks = (b"x" * 65536 for _ in range(8))
    response = httpx.post(
        f"{url}/v1/completions", content=chunks, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_openai_error(response, 413, "max-request-body-bytes")


def test_logit_bias_steers_greedy_decoding(server):
    base = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    plain = send(server.url, "/tokenize", {"prompt": " Paris", "add_special_tokens": False}).json()["tokens"]
    biased = send(server.url, "/v1/completions", base | {"logit_bias": {str(plain[0]): 100}}).json()
    assert biased["choices"][0]["text"].startswith(" Paris Paris")
    banned = send(server.url, "/v1/completions", base | {"logit_bias": {str(plain[0]): -100}}).json()
    assert "Paris" not in banned["choices"][0]["text"].split()[0]


@pytest.fixture(scope="module")
def truncating():
    remote = RemoteServer([*shared_server_args(), "--truncate-chat-history"])
    yield remote
    remote.stop()


@pytest.mark.slow  # a 3.5 MB conversation
def test_a_long_history_costs_bounded_work_and_no_stream_stalls(truncating):
    """--truncate-chat-history once rendered and tokenized the whole conversation at every step of a
    search: one 3.5 MB request held the tokenizer thread for 84 s. Now what must stay is bounded by
    its size before any tokenizing, and a cut costs one batch of counts and a few small renders."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: tell me more"}
        for i in range(2_000)
    ]
    last = {"role": "user", "content": "Summarize in one line."}
    victim = Stream(truncating.url)
    start = time.monotonic()
    system = HUGE_TEXT[:120_000]  # with the turns, just under the body bound
    big = {"messages": [{"role": "system", "content": system}, *turns, last], "max_tokens": 4}
    assert_openai_error(send(truncating.url, "/v1/chat/completions", big), 400, "messages")
    long_system = {"messages": [{"role": "system", "content": "word " * 2_000}, *turns, last]}
    assert_openai_error(send(truncating.url, "/v1/chat/completions", long_system), 400, "alone are")
    body = {"messages": [{"role": "system", "content": "Be terse."}, *turns, last], "max_tokens": 4}
    reply = send(truncating.url, "/v1/chat/completions", body)
    assert time.monotonic() - start < 60  # the old search: minutes on two shared cores
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["dropped_messages"] > 1_900 and usage["dropped_prompt_tokens"] > 10_000
    assert usage["prompt_tokens"] + 4 <= TEST_ENGINE_ARGS["max_model_len"]
    victim.join()
    assert not victim.errors and victim.finish_reason == "length"


def test_history_truncation_tokenizes_once_and_renders_a_few_times():
    """The cost of a cut on cached per-message counts, counted: one batch of counts, at most
    MAX_RENDERS renders (none of the whole conversation when its texts alone are too long)."""
    calls = {"count": 0, "render": 0}

    async def count_tokens(texts: list[str]) -> list[int]:
        calls["count"] += 1
        return [len(text.split()) for text in texts]

    async def render(messages: list[ChatMessage]) -> dict:
        calls["render"] += 1
        num_tokens = sum(len(str(m.content).split()) + 5 for m in messages) + 20  # per message, per prompt
        return {"prompt_token_ids": [0] * num_tokens}

    def fit(messages: list[ChatMessage], room: int = 500, max_chars_per_token: int | None = 20):
        calls.update(count=0, render=0)
        texts = [str(m.content) for m in messages]
        run = chat_history.fit_history(
            messages,
            texts,
            room,
            render=render,
            count_tokens=count_tokens,
            max_chars_per_token=max_chars_per_token,
        )
        return asyncio.run(run)

    system = ChatMessage(role="system", content="be terse")
    turns = [
        ChatMessage(role="user" if i % 2 == 0 else "assistant", content=f"turn {i} " + "word " * (i % 7))
        for i in range(2_001)
    ]
    prompt, cut = fit([system, *turns])
    assert len(prompt["prompt_token_ids"]) <= 500 and cut is not None and cut.messages > 1_900
    assert calls["count"] == 1 and calls["render"] <= chat_history.MAX_RENDERS
    prompt, cut = fit([system, *turns[-5:]])  # fits whole: one render, nothing said
    assert cut is None and calls == {"count": 1, "render": 1}
    with pytest.raises(ValueError, match=r"^messages: .* characters"):
        fit([ChatMessage(role="system", content="word " * 10_000), *turns])
    assert calls == {"count": 0, "render": 0}  # refused on its size alone
    with pytest.raises(ValueError, match=r"^messages: the system messages and the last message alone"):
        fit([ChatMessage(role="system", content="word " * 1_000), *turns], max_chars_per_token=None)
    assert calls == {"count": 1, "render": 0}


@pytest.mark.slow  # a long prompt prefilled whole
def test_truncate_prompt_tokens_minus_one_leaves_room_to_generate(server):
    """vLLM's -1, "truncate to the model's length", once kept max_model_len tokens: no room, a 400."""
    text = "The history of paged memory. " * 300  # over max_model_len
    max_model_len = TEST_ENGINE_ARGS["max_model_len"]
    body = {"prompt": text, "truncate_prompt_tokens": -1, "max_tokens": 4}
    reply = send(server.url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == max_model_len - 4
    chat = {"messages": [{"role": "user", "content": text}], "truncate_prompt_tokens": -1}
    reply = send(server.url, "/v1/chat/completions", chat)  # no max_tokens: room for one
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == max_model_len - 1


def test_prompt_logprobs_on_completions_whole_and_streamed(server):
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    tokens = send(server.url, "/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
    [choice] = send(server.url, "/v1/completions", body).json()["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    for token_id, entry in zip(tokens[1:], entries[1:], strict=True):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0
        assert len(entry) <= 2  # the prompt's token and the top 1
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0].get("prompt_logprobs") for c in chunks if c["choices"]]
    assert streamed[0] == entries and not any(streamed[1:])
    assert (
        "prompt_logprobs"
        not in send(server.url, "/v1/completions", body | {"prompt_logprobs": None}).json()["choices"][0]
    )


def test_open_metrics_do_not_name_callers_when_the_api_needs_a_key(server):
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "user": "caller-who-must-stay-private"}
    assert send(server.url, "/v1/completions", body).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200  # open, as vLLM's: scrapers need no key
    assert "caller-who-must-stay-private" not in metrics.text
    assert "prefix_cache_queries_by_prompt_length" in metrics.text


# ---- a trusting server with faults injected ---------------------------------------------------------


@pytest.fixture(scope="module")
def faulty():
    args = [*shared_server_args(), "--trust-request-chat-template", "--chat-template-time-budget", "1"]
    remote = RemoteServer(args, module="tests.fault_server")
    yield remote
    remote.stop()


@pytest.mark.slow  # a server of its own, templates that run to their budget
def test_a_runaway_template_stops_at_its_budget_and_no_stream_stalls(faulty):
    victim = Stream(faulty.url, max_tokens=100)
    start = time.monotonic()
    response = send(faulty.url, "/v1/chat/completions", {"messages": CHAT, "chat_template": NESTED_LOOPS})
    assert_openai_error(response, 400, "time budget of 1 s")
    assert time.monotonic() - start < 30  # stopped at its budget, not run to its end
    response = send(faulty.url, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1 / 0 }}"})
    assert_openai_error(response, 400, "ZeroDivisionError")
    response = send(
        faulty.url, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ ''.__class__.__mro__ }}"}
    )
    assert_openai_error(response, 400, "unsafe")
    trusted = {"messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"}
    assert send(faulty.url, "/v1/chat/completions", trusted).json()["usage"]["prompt_tokens"] == 1
    victim.join()
    assert not victim.errors and victim.finish_reason == "length"


@pytest.mark.parametrize(  # make test-fast keeps the sampler's fault
    "seed", [SAMPLING_FAULT_SEED, pytest.param(DETOKENIZE_FAULT_SEED, marks=pytest.mark.slow)]
)
def test_a_fault_inside_one_request_fails_it_alone(faulty, llm, seed):
    from pagedllm import SamplingParams

    prompts = ["The capital of France is", "List three colours:"]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    results: list[httpx.Response | None] = [None, None]

    def run(index: int) -> None:
        body = {"prompt": prompts[index], "max_tokens": 24, "temperature": 0}
        results[index] = send(faulty.url, "/v1/completions", body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    bad = send(
        faulty.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 24, "seed": seed, "temperature": 0.7}
    )
    for thread in threads:
        thread.join()
    assert_openai_error(bad, 500, "injected")
    assert bad.json()["error"]["code"] == "request_failed"
    for response, reference in zip(results, expected, strict=True):
        assert response is not None and response.status_code == 200
        assert response.json()["choices"][0]["text"] == reference.outputs[0].text
    kv_cache = httpx.get(f"{faulty.url}/stats", headers=AUTH).json()["kv_cache"]
    assert kv_cache["free_blocks"] == kv_cache["num_blocks"]  # the failed request's blocks came back
    assert httpx.get(f"{faulty.url}/health").status_code == 200


def test_a_fault_in_the_forward_pass_stops_the_server_with_status_1_and_says_why(faulty):
    """Last: it ends the server."""
    victim = Stream(faulty.url, max_tokens=500)
    bad = send(faulty.url, "/v1/completions", {"prompt": [1, 2, FORWARD_FAULT_TOKEN], "max_tokens": 4})
    assert_openai_error(bad, 503, "injected forward fault")
    victim.join()
    assert victim.errors and "injected forward fault" in victim.errors[0]["error"]["message"]
    assert faulty.proc.wait(60) == 1
    log = "".join(faulty.lines)
    assert "The engine failed (RuntimeError: injected forward fault)" in log and "exits with status 1" in log
