"""Tools in a chat request: how they reach the prompt, what the model may write, how calls come back.

    tool_choice  prompt         grammar                            reply
    none         no tools       the request's own                  content
    auto         with tools     the request's own                  content and calls (--tool-call-parser)
    required     with tools     a JSON list of {name, parameters}  the calls of that list
    {function}   with tools     that function's parameters schema  one call: the output is its arguments

Grammars make `required` and a named function always valid JSON (vLLM does the same). A chat
template that uses `tools` gets them as its variable; one that does not (SmolLM2's) gets them as a
Hermes-style system text, and earlier calls and tool results in the conversation are written the
same way, so the model sees the format the `hermes` parser reads back.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import quoted
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolCallParser, make_parser
from pagedllm.sampling_params import StructuredOutputsParams

MAX_TOOLS = 128
"""OpenAI's own limit on tools per request."""

_TOOLS_SYSTEM_TEXT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]
    """The request's tools as OpenAI dicts, for the prompt; empty with tool_choice none."""
    mode: str
    """none | auto | required | named"""
    function: str | None = None
    """The named function (mode named)."""
    grammar: StructuredOutputsParams | None = None
    parser_name: str | None = None

    def parser(self) -> ToolCallParser | None:
        return make_parser(self.parser_name) if self.mode == "auto" and self.parser_name else None


def plan_tools(request: ChatCompletionRequest, parser_name: str | None) -> ToolPlan | None:
    """What the request's tools and tool_choice mean; None when it has no tools. ValueError
    naming the field for a choice that cannot be served."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools")
    dicts = [tool.model_dump(exclude_none=True) for tool in tools]
    schemas = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in tools}
    if len(schemas) < len(tools):
        raise ValueError("tools: two tools have the same name")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan([], "none")
    if choice == "auto":
        if parser_name is None:
            raise ValueError(
                'tool_choice: "auto" is off on this server (--no-enable-auto-tool-choice); '
                'use "required" or name a function'
            )
        return ToolPlan(dicts, "auto", parser_name=parser_name)
    if request.response_format is not None and request.response_format.type != "text":
        raise ValueError("response_format: cannot be combined with a tool_choice that forces a call")
    if choice == "required":
        call_item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                }
                for name, schema in schemas.items()
            ]
        }
        schema = {"type": "array", "minItems": 1, "items": call_item}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(dicts, "required", grammar=StructuredOutputsParams(json=schema))
    name = choice.function.name  # protocol.py has checked the shape
    if name not in schemas:
        raise ValueError(f"tool_choice: no tool named {quoted(name)} among the tools")
    return ToolPlan(dicts, "named", function=name, grammar=StructuredOutputsParams(json=schemas[name]))


def template_uses_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def conversation_for_template(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]], template_has_tools: bool
) -> list[dict[str, Any]]:
    """The conversation as a template without tool support should see it: the tools in the system
    message, earlier calls as <tool_call> text, tool results as <tool_response> user turns."""
    if template_has_tools:
        return conversation
    messages: list[dict[str, Any]] = []
    for message in conversation:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call_text(call) for call in message["tool_calls"]]
            content = "\n".join([message.get("content") or "", *calls]).strip()
            messages.append({"role": "assistant", "content": content})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if messages and messages[-1].get("role") == "user" and messages[-1].get("_tool_responses"):
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n" + response}
            else:
                messages.append({"role": "user", "content": response, "_tool_responses": True})
        else:
            messages.append(message)
    messages = [{k: v for k, v in m.items() if k != "_tool_responses"} for m in messages]
    if tools:
        text = _TOOLS_SYSTEM_TEXT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{text}".strip()}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages


def calls_from_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """The reply's content and tool calls, from the whole output."""
    if plan.mode == "named":
        return None, [ParsedToolCall(plan.function or "", text)]
    if plan.mode == "required":
        return None, required_calls(text)
    parser = plan.parser()
    if parser is None:
        return text, []
    return parser.parse(text)


def required_calls(text: str) -> list[ParsedToolCall]:
    """Calls from a `required` reply (a JSON list); none if it was cut short."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [
        ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolStream:
    """One streamed choice's text -> content deltas and tool call deltas. Named: the output is the
    call's arguments, streamed as they come; required: calls at the end (the JSON list must be
    whole); auto: the parser holds back a possible call until its closing tag."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan if plan is not None and plan.mode != "none" else None
        self.parser = self.plan.parser() if self.plan is not None else None
        self.num_calls = 0
        self._text = ""

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        if self.plan is None:
            return text, []
        if self.plan.mode == "named":
            calls = []
            if self.num_calls == 0 and (text or finished):
                calls.append(self._header(self.plan.function or "", text))
            elif text:
                calls.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text)))
            return "", calls
        if self.plan.mode == "required":
            self._text += text
            if not finished:
                return "", []
            return "", [self._header(call.name, call.arguments) for call in required_calls(self._text)]
        if self.parser is None:
            return text, []
        content, parsed = self.parser.feed(text)
        if finished:
            rest, last = self.parser.finish()
            content, parsed = content + rest, parsed + last
        return content, [self._header(call.name, call.arguments) for call in parsed]

    def _header(self, name: str, arguments: str) -> DeltaToolCall:
        """A call's first delta: its index, id, type and name, with the arguments so far."""
        call = DeltaToolCall(
            index=self.num_calls,
            id=new_call_id(),
            type="function",
            function=DeltaFunctionCall(name=name, arguments=arguments),
        )
        self.num_calls += 1
        return call


def _call_text(call: dict[str, Any]) -> str:
    """One earlier call (a protocol.MessageToolCall as a dict) as the hermes parser reads it back."""
    function = call["function"]
    arguments = function["arguments"]
    with contextlib.suppress(ValueError):  # else written as the client sent it
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
