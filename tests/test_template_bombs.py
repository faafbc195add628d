"""A chat template is untrusted input (issue 45): it comes with the model file, or from a client
the operator trusts with --trust-request-chat-template. Every template that once took the
process's memory or a thread (a 2 GB `%` width, `center(5e9)`, lipsum, repetition, concatenation
in a loop, output past any prompt the model takes, a loop that never ends) is refused with a
ValueError naming why, in bounded time and memory: offline (chat_prompt, LLM.chat) and as a
request to a real server, where a bystander's stream, chat and encode complete meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import httpx
import psutil
import pytest

from pagedllm import chat_template
from pagedllm.engine.async_tokenizer import AsyncTokenizer
from pagedllm.model.locate import resolve_model_folder
from pagedllm.tokenizer import chat_prompt, load_tokenizer, max_prompt_chars, max_token_chars

from .helpers import TEST_ENGINE_ARGS, RemoteServer, assert_openai_error, server_engine_args

CHAT = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = cast(int, TEST_ENGINE_ARGS["max_model_len"])
BUDGET_S = 1.0
MAX_RSS_GROWTH = 256 * 1024**2
BIG = "{% set a = 'x' * 40000 %}"  # three of them are over the test model's bound (82,944 characters)
LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"

# (id, template, a piece of the refusal's message)
BOMBS = [
    ("format width", "{{ '%2000000000s'|format('x') }}", "a field 2,000,000,000 characters wide"),
    ("format precision", "{{ '%.2000000000f'|format(1.0) }}", "a field 2,000,000,000 characters wide"),
    ("% width", "{{ '%2000000000s' % 'x' }}", "a field 2,000,000,000 characters wide"),
    ("str.format width", "{{ '{:>2000000000}'.format('x') }}", "a field 2,000,000,000 characters wide"),
    ("safe str.format", "{{ ('{:>2000000000}'|safe).format('x') }}", "a field 2,000,000,000 characters wide"),
    ("* width", "{{ '%*s' % (2000000000, 'x') }}", "`*` widths"),
    ("center", "{{ 'x'|center(5000000000) }}", "`center` of about 5,000,000,000 characters"),
    ("ljust", "{{ 'x'.ljust(10**10) }}", "`ljust`"),
    ("zfill", "{{ '1'.zfill(10**10) }}", "`zfill`"),
    ("indent", "{{ ('x\\n' * 40000)|indent(100000) }}", "`indent`"),
    ("wordwrap", "{{ ('a ' * 30000)|wordwrap(1, wrapstring='x' * 10000) }}", "`wordwrap`"),
    ("replace", "{{ ('a' * 50000)|replace('a', 'b' * 50000) }}", "`replace`"),
    ("str.replace", "{{ ('a' * 50000).replace('a', 'b' * 50000) }}", "`replace`"),
    ("truncate end", "{{ 'x'|truncate(1, end='y' * 10**9) }}", "a repetition"),
    ("lipsum", "{{ lipsum(n=10**9) }}", "`lipsum`"),
    ("range", "{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("repetition", "{{ 'x' * 10**9 }}", "a repetition of about 1,000,000,000 characters"),
    ("list repetition", "{{ (['x' * 50000] * 100000)|length }}", "a repetition"),
    (
        "~ in a loop",
        "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "a `~` concatenation",
    ),
    (
        "+ in a loop",
        "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
        "{% set ns.l = ns.l + ['x' * 50000 ~ i] %}{% endfor %}",
        "a `+` concatenation",
    ),
    ("join", BIG + "{{ [a, a, a]|join }}", "`join`"),
    ("str.join", BIG + "{{ ''.join([a, a, a]) }}", "`join`"),
    ("a structure output", BIG + "{{ [a, a, a] }}", "an output"),
    ("string", BIG + "{{ [a, a, a]|string }}", "`string`"),
    ("tojson", BIG + "{{ [a, a, a]|tojson }}", "`tojson`"),
    ("tojson indent", "{{ [[[[1]]]]|tojson(indent=10**9) }}", "`tojson`"),
    ("% of a mapping", BIG + "{{ ('%(a)s' * 3) % {'a': a} }}", "a % formatting"),
    ("str.format fields", BIG + "{{ ('{0}' * 3).format(a) }}", "a str.format"),
    ("dict.fromkeys", BIG + "{{ {}.fromkeys(range(100000), a)|length }}", "the result of fromkeys"),
    ("sum of lists", "{% set l = [0] * 10000 %}{{ [l, l, l, l, l]|sum(start=[])|length }}", "`sum`"),
    ("batch fill", "{{ [1]|batch(10**9, 0)|list|length }}", "`batch`"),
    ("slice", "{{ [1]|slice(10**9)|list|length }}", "`slice`"),
    ("expandtabs", "{{ ('\\t' * 50000).expandtabs(100000) }}", "`expandtabs`"),
    ("translate", "{{ ('a' * 50000).translate({97: 'b' * 50000}) }}", "`translate`"),
    (
        "integer products",
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "products over 4096 bits",
    ),
    ("integer powers", "{{ (10**60) ** 60 }}", "powers over 4096 bits"),
    (
        "output past the bound",
        "{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "a prompt of about",
    ),
    (
        "a block past the bound",
        "{% set x %}{% for a in range(100000) %}{{ 'y' * 10000 }}{% endfor %}{% endset %}{{ x }}",
        "a block",
    ),
    (
        "a macro past the bound",
        "{% macro m() %}{% for a in range(10**5) %}{{ 'q' * 1000 }}{% endfor %}{% endmacro %}{{ m() }}",
        "a block",
    ),
    (
        "a filter block",
        "{% filter upper %}{% for a in range(10**5) %}{{ 'q' * 1000 }}{% endfor %}{% endfilter %}",
        "a block",
    ),
    ("recursive macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("recursive loop", "{% for a in [[1]] recursive %}{{ loop([a]) }}{% endfor %}", "RecursionError"),
    ("loops without output", LOOPS, "time budget of 1 s"),
    ("a buffered loop", "{% set x %}" + LOOPS + "{% endset %}", "time budget of 1 s"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_folder(None))


@pytest.fixture(scope="module")
def max_chars(tokenizer) -> int:
    """The test model's bound, as a server or LLM with TEST_ENGINE_ARGS sets it."""
    return max_prompt_chars(MAX_MODEL_LEN, max_token_chars(tokenizer))


class PeakRss:
    """The process's resident memory at its highest while the block runs, sampled on a thread
    (a step that holds the GIL is seen by ru_maxrss, the kernel's own peak, instead)."""

    def __enter__(self) -> PeakRss:
        self.process = psutil.Process(os.getpid())
        self.start = self.peak = self.process.memory_info().rss
        self.start_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.maxrss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start_maxrss

    @property
    def growth(self) -> int:
        return max(self.peak - self.start, self.maxrss_growth)


def test_the_bound_is_max_model_len_times_a_tokens_characters(tokenizer, max_chars):
    assert max_chars == MAX_MODEL_LEN * (max_token_chars(tokenizer) or 0) == 82_944
    assert max_prompt_chars(1024, None) == 1024 * 64  # a normalizing tokenizer: the fallback
    assert max_prompt_chars(10**9, 81) == 16 * 1024**2  # never over MAX_CHAT_TEMPLATE_CHARS


@pytest.mark.parametrize(("template", "reason"), [b[1:] for b in BOMBS], ids=[b[0] for b in BOMBS])
def test_a_bomb_is_refused_in_bounded_time_and_memory(tokenizer, max_chars, template, reason):
    start = time.monotonic()
    with PeakRss() as rss, pytest.raises(ValueError, match=re.escape(reason)):
        chat_prompt(tokenizer, CHAT, template=template, time_budget=BUDGET_S, max_chars=max_chars)
    assert time.monotonic() - start < BUDGET_S + 10  # generous: the host may be busy
    assert rss.growth < MAX_RSS_GROWTH, f"{rss.growth / 2**20:.0f} MiB"


def test_a_template_may_build_up_to_the_bound_and_no_more(tokenizer, max_chars):
    def render(template: str) -> str:
        return chat_prompt(tokenizer, CHAT, template=template, max_chars=max_chars)["prompt"]

    assert len(render(f"{{{{ 'x' * {max_chars} }}}}")) == max_chars
    assert len(render(f"{{{{ 'x'|center({max_chars}) }}}}")) == max_chars
    assert len(render(f"{{% for i in range({max_chars}) %}}x{{% endfor %}}")) == max_chars
    for template in (
        f"{{{{ 'x' * {max_chars + 1} }}}}",
        f"{{% for i in range({max_chars + 1}) %}}x{{% endfor %}}",
    ):
        with pytest.raises(ValueError, match=f"over the {max_chars:,} that bound a prompt"):
            render(template)


def test_running_out_of_memory_is_the_requests_error(tokenizer, monkeypatch):
    def allocate() -> str:
        raise MemoryError

    monkeypatch.setitem(chat_template._environment().globals, "allocate", allocate)
    with pytest.raises(ValueError, match="the chat template ran out of memory"):
        chat_prompt(tokenizer, CHAT, template="{{ allocate() }}")


@pytest.mark.slow  # renders that run to their budgets, in threads
def test_the_renders_of_other_threads_keep_their_own_budgets(tokenizer, max_chars):
    """The deadline and the bound are per thread: a bomb on one does not stop a render on another."""
    with ThreadPoolExecutor(2) as pool:
        bomb = pool.submit(chat_prompt, tokenizer, CHAT, template=LOOPS, time_budget=2.0, max_chars=max_chars)
        time.sleep(0.2)
        fine = pool.submit(chat_prompt, tokenizer, CHAT, max_chars=max_chars)
        assert fine.result(timeout=30)["prompt"].endswith("<|im_start|>assistant\n")
        with pytest.raises(ValueError, match="time budget of 2 s"):
            bomb.result(timeout=30)


@pytest.mark.slow  # a render that runs to its budget
def test_a_bystanders_encode_does_not_wait_behind_a_render(tokenizer):
    """The server's AsyncTokenizer renders templates on threads apart from tokenizing: an encode
    sent while a template runs to its budget is answered while that render still runs."""

    async def run() -> None:
        async_tokenizer = AsyncTokenizer(tokenizer, template_time_budget=5.0)
        try:
            bomb = asyncio.ensure_future(
                async_tokenizer.chat_prompt(CHAT, True, template=LOOPS, max_model_len=MAX_MODEL_LEN)
            )
            await asyncio.sleep(0.2)
            assert not bomb.done()
            ids = await async_tokenizer.encode(["Hello there"])
            assert ids == [tokenizer("Hello there").input_ids] and not bomb.done()
            fine = await async_tokenizer.chat_prompt(CHAT, True, max_model_len=MAX_MODEL_LEN)
            assert fine["prompt_token_ids"] == chat_prompt(tokenizer, CHAT)["prompt_token_ids"]
            assert not bomb.done()
            with pytest.raises(ValueError, match="time budget of 5 s"):
                await bomb
        finally:
            async_tokenizer.shutdown()

    asyncio.run(run())


@pytest.mark.slow  # templates that run to their budget
def test_offline_chat_has_the_servers_budget_and_bound(llm, monkeypatch):
    """LLM.chat renders the model's own template, which is untrusted: a runaway one is a ValueError."""
    tokenizer = llm.get_tokenizer()
    monkeypatch.setattr(tokenizer, "chat_template", "{{ 'x' * 90000 }}")  # over 1024 tokens' 82,944
    with pytest.raises(ValueError, match="a repetition of about 90,000 characters, over the 82,944"):
        llm.chat(CHAT, use_tqdm=False)
    monkeypatch.setattr(tokenizer, "chat_template", LOOPS)
    start = time.monotonic()
    with pytest.raises(ValueError, match="time budget of 5 s"):
        llm.chat(CHAT, use_tqdm=False)
    assert time.monotonic() - start < 5 + 10
    monkeypatch.undo()
    assert llm.chat(CHAT, use_tqdm=False)[0].outputs[0].token_ids  # the model's own still serves


# ---- against a real server ------------------------------------------------------------------------

SERVER_BUDGET_S = 2
SERVER_BOMBS = [
    ("{{ '%2000000000s'|format('x') }}", "characters wide"),
    ("{{ 'x'|center(5000000000) }}", "`center`"),
    ("{{ lipsum(n=10**9) }}", "`lipsum`"),
    (
        "{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "a prompt of",
    ),
    (LOOPS, f"time budget of {SERVER_BUDGET_S} s"),
]


@pytest.fixture(scope="module")
def trusting():
    args = [*server_engine_args(), "--trust-request-chat-template", "--chat-template-time-budget", "2"]
    remote = RemoteServer(args)
    yield remote
    remote.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def stream_text(url: str, body: dict) -> str:
    """A completion streamed whole: its text (any error event fails the test)."""
    text = ""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return text


@pytest.mark.slow  # a server of its own, templates that run to their budget
def test_a_bomb_request_is_a_400_and_bystanders_complete(trusting):
    url = trusting.url
    story = {"prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    question = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    alone_story = post(url, "/v1/completions", story).json()["choices"][0]["text"]
    alone_answer = post(url, "/v1/chat/completions", question).json()["choices"][0]["message"]["content"]
    alone_tokens = post(url, "/tokenize", {"prompt": "Hello there"}).json()["tokens"]
    server = psutil.Process(trusting.proc.pid)
    rss_before = server.memory_info().rss
    with ThreadPoolExecutor(8) as pool:
        bystander_stream = pool.submit(stream_text, url, story)
        bombs = [
            pool.submit(post, url, "/v1/chat/completions", {"messages": CHAT, "chat_template": template})
            for template, _ in SERVER_BOMBS
        ]
        time.sleep(0.5)  # the looping template is rendering now: bystanders are served meanwhile
        answer = pool.submit(post, url, "/v1/chat/completions", question)
        tokens = pool.submit(post, url, "/tokenize", {"prompt": "Hello there"})
        assert tokens.result().json()["tokens"] == alone_tokens
        assert answer.result().json()["choices"][0]["message"]["content"] == alone_answer
        for bomb, (_, reason) in zip(bombs, SERVER_BOMBS, strict=True):
            assert_openai_error(bomb.result(), 400, reason)
        assert bystander_stream.result() == alone_story
    assert server.memory_info().rss - rss_before < MAX_RSS_GROWTH
    assert httpx.get(f"{url}/health").status_code == 200
