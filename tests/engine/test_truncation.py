"""History that outgrows the context: truncate_prompt_tokens (vLLM's field) keeps a prompt's last k
tokens, checked against the plain path on those tokens; --truncate-chat-history drops a chat's
oldest turns (never the system message or the last message) and says so in usage, checked against
sending the kept messages directly."""

from __future__ import annotations

import openai
import pytest

from pagedllm import SamplingParams

from ..helpers import MODEL, RemoteServer

pytestmark = pytest.mark.slow  # two servers of its own

MAX_MODEL_LEN = 512
TURN = "Tell me more about the history of paged memory in operating systems and databases. " * 3


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_truncate_prompt_tokens_equals_the_plain_path_on_the_last_tokens(llm):
    ids = llm.get_tokenizer()(TURN * 25).input_ids
    assert len(ids) > 1024  # longer than the test engine's max_model_len
    [cut] = llm.generate([{"prompt_token_ids": ids}], greedy(truncate_prompt_tokens=300), use_tqdm=False)
    [plain] = llm.generate([{"prompt_token_ids": ids[-300:]}], greedy(), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-300:]
    assert cut.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.fixture(scope="module")
def servers():
    common = [
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "128MiB",
    ]
    truncating = RemoteServer([*common, "--truncate-chat-history", "--disable-log-stats"])
    plain = RemoteServer([*common, "--disable-log-stats"])
    clients = [
        openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
        for s in (truncating, plain)
    ]
    yield clients
    truncating.stop()
    plain.stop()


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a terse historian."}]
    for i in range(turns):
        messages += [
            {"role": "user", "content": f"{i}: {TURN}"},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    return [*messages, {"role": "user", "content": "Summarize in one line."}]


def test_chat_history_is_cut_from_the_oldest_turn_and_usage_says_so(servers):
    truncating, plain = servers
    messages = conversation(12)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    reply = truncating.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    usage = reply.usage.model_extra
    dropped = usage["dropped_messages"]
    assert dropped > 0 and usage["dropped_prompt_tokens"] > 0
    assert reply.usage.prompt_tokens + 16 <= MAX_MODEL_LEN
    kept = [messages[0], *messages[1 + dropped :]]
    assert kept[1]["role"] == "user"  # the cut falls before a question, not inside a turn
    direct = plain.chat.completions.create(model=MODEL, messages=kept, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == direct.choices[0].message.content
    assert reply.usage.prompt_tokens == direct.usage.prompt_tokens
    assert reply.usage.prompt_tokens + usage["dropped_prompt_tokens"] > MAX_MODEL_LEN - 16
    short = truncating.chat.completions.create(
        model=MODEL, messages=conversation(1), max_tokens=4, temperature=0
    )
    assert "dropped_messages" not in short.usage.model_extra  # nothing cut, nothing said


def test_truncate_prompt_tokens_on_the_server(servers):
    truncating, _ = servers
    reply = truncating.completions.create(
        model=MODEL, prompt=TURN * 12, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 200}
    )
    assert reply.usage.prompt_tokens == 200
