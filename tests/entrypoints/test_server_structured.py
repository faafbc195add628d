"""Structured output and tools through the server, with the official openai client: the JSON
parses and validates against the schema (whole, streamed, batched), tool calls come back as
tool_calls (named, required, auto, streamed as deltas), a tool result round-trips, and a bad
grammar or tool_choice is a 400 that leaves the server serving."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser

from ..helpers import (
    API_KEY,
    ASK,
    MODEL,
    PERSON,
    WEATHER,
    nested_schema_text,
)
from ..schema_bombs import ref_chain_schema_text, ref_diamond_schema

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, **kwargs}
    return client.chat.completions.create(**kwargs)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.slow  # three constrained replies, streamed and not; the fast set keeps the tool tests
def test_chat_json_schema_whole_streamed_and_n(client):
    whole = chat(client, response_format=json_schema_format(PERSON), n=2, seed=3)
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = chat(client, response_format=json_schema_format(PERSON), stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllm_fields_on_completions(client):
    reply = chat(client, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    batch = client.completions.create(
        model=MODEL,
        prompt=["The phone number is ", "Pick a colour: "],
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    )
    assert all(len(c.text) == 8 and c.text[3] == "-" for c in batch.choices), batch.choices
    choice = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["blue", "green"]}},
    )
    assert choice.choices[0].text in ("blue", "green")


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "xml"}},
        {"structured_outputs": {"regex": "("}},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"structured_outputs": {"choice": ["\U00040000"]}},  # no token can begin it
        {"structured_outputs": {"choice": ["0\U00040000"]}},  # ... nor go on after "0"
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"tool_choice": "required"},
        {"tools": [WEATHER, WEATHER]},
    ],
)
def test_bad_structured_requests_are_400s(client, extra):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert chat(client, max_tokens=2).choices[0].message.content is not None


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (nested_schema_text(450), "nested deeper than 64 levels"),
        (ref_chain_schema_text(450), r"nested deeper than 64 levels .*counting each \$ref"),  # flat text
        (ref_diamond_schema(20), r"over 100,000 objects and lists once each \$ref"),
        ("[" * 30_000 + "]" * 30_000, "nested deeper than 64 levels"),  # json.loads: RecursionError
        (
            {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
            "points outside the schema",
        ),
    ],
)
def test_schemas_too_deep_or_remote_are_400s_before_compiling(client, schema, message):
    """The message is the check's, not the compile timeout's: refused before any compile."""
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, max_tokens=4, extra_body={"structured_outputs": {"json": schema}})
    reply = chat(client, response_format=json_schema_format(PERSON))
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_named_tool_choice_returns_a_valid_call(client):
    reply = chat(
        client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_returns_valid_calls(client):
    reply = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_calls_assemble_to_the_whole_reply(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        whole = chat(client, tools=[WEATHER, TIME], tool_choice=choice).choices[0].message.tool_calls
        calls: dict[int, dict] = {}
        for chunk in chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                entry["name"] = entry["name"] or delta.function.name
                entry["arguments"] += delta.function.arguments or ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole
        ]


def test_auto_tool_choice_puts_the_tools_in_the_prompt_and_parses_what_comes(client):
    plain = chat(client, max_tokens=40)
    auto = chat(client, tools=[WEATHER], max_tokens=40)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' text is in the prompt
    message = auto.choices[0].message
    _, calls = HermesToolParser().parse(message.content or "")
    assert calls == []  # anything the parser could take came back as tool_calls, not text
    for call in message.tool_calls:
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)
    none = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=40)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens and not none.choices[0].message.tool_calls


@pytest.mark.slow  # the fast set keeps the tool-call tests
def test_a_tool_result_round_trips(client):
    first = chat(
        client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
