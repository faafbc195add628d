"""Tool calls out of a model's text (`--tool-call-parser`, vLLM's flag), whole and streamed.

`hermes`: the format of the Hermes, Qwen2.5 and SmolLM2 families, one call per tag:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's content. A tag whose body is not a JSON call stays content,
so nothing the model wrote is lost; a last call the model did not close (it stopped at EOS or a
stop string) is still taken if its body is a whole call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI's API carries it."""


class ToolCallParser:
    """Splits text into content and tool calls; `feed` the stream's text deltas, then `finish`."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Content that can go out now, and calls completed by this delta."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """What the stream held back: content, and a last call left unclosed."""
        raise NotImplementedError


class HermesToolParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def __init__(self) -> None:
        self._pending = ""  # text not yet sent: a possible start of OPEN, or an open call

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls: list[ParsedToolCall] = []
        content: list[str] = []
        position = 0
        for match in self._CALL.finditer(text):
            call = _call_from_json(match.group(1))
            if call is None:
                continue  # stays in the content
            content.append(text[position : match.start()])
            position = match.end()
            calls.append(call)
        content.append(text[position:])
        joined = "".join(content)
        if calls:
            joined = joined.strip()
        return (joined or None) if calls else joined, calls

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self._pending += delta
        out: list[str] = []
        calls: list[ParsedToolCall] = []
        while self._pending:
            start = self._pending.find(self.OPEN)
            if start < 0:
                keep = _longest_prefix_at_end(self._pending, self.OPEN)
                out.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            out.append(self._pending[:start])
            self._pending = self._pending[start:]
            end = self._pending.find(self.CLOSE)
            if end < 0:
                break  # inside a call: wait for its end
            body = self._pending[len(self.OPEN) : end]
            call = _call_from_json(body)
            if call is None:
                out.append(self._pending[: end + len(self.CLOSE)])
            else:
                calls.append(call)
            self._pending = self._pending[end + len(self.CLOSE) :]
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        pending, self._pending = self._pending, ""
        if pending.startswith(self.OPEN):
            call = _call_from_json(pending[len(self.OPEN) :])
            if call is not None:
                return "", [call]
        return pending, []


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolParser}


def make_parser(name: str) -> ToolCallParser:
    return TOOL_CALL_PARSERS[name]()


def _call_from_json(body: str) -> ParsedToolCall | None:
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedToolCall(value["name"], arguments)
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _longest_prefix_at_end(text: str, tag: str) -> int:
    """Length of the longest start of `tag` that `text` ends with (it may continue next delta)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
