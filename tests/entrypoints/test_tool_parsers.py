"""The hermes tool call parser, whole and streamed: a stream cut anywhere gives the whole parse."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, ParsedToolCall
from pagedllm.entrypoints.openai.tools import conversation_for_template

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "Just prose, no call.",
    f"Let me check.\n{CALL}",
    f"{CALL}\n{CALL.replace('Paris', 'Tokyo')}",
    "<tool_call>not json</tool_call> and more",
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}',  # unclosed at the end, but whole
    "a < b and <tool_ <tool_call",
    "",
]


def test_parse():
    assert HermesToolParser().parse(TEXTS[0]) == (TEXTS[0], [])
    assert HermesToolParser().parse(TEXTS[1]) == (
        "Let me check.",
        [ParsedToolCall("get_weather", json.dumps({"city": "Paris"}))],
    )
    content, calls = HermesToolParser().parse(TEXTS[2])
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Tokyo"]
    assert HermesToolParser().parse(TEXTS[3]) == (TEXTS[3], [])  # nothing lost
    assert HermesToolParser().parse(TEXTS[4]) == (None, [ParsedToolCall("f", '{"a": 1}')])


@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=8))
def test_streaming_equals_whole(text, cuts):
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    parser = HermesToolParser()
    content, calls = "", []
    for piece in pieces:
        more, new = parser.feed(piece)
        content, calls = content + more, calls + new
    rest, last = parser.finish()
    content, calls = content + rest, calls + last
    whole_content, whole_calls = HermesToolParser().parse(text)
    assert calls == whole_calls
    assert content.strip() == (whole_content or "").strip()


def test_a_template_without_tools_sees_them_as_hermes_text():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "warm"},
    ]
    messages = conversation_for_template(conversation, tools, template_has_tools=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert (
        messages[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    )
    assert conversation_for_template(conversation, tools, template_has_tools=True) is conversation
