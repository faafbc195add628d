"""The text a request's prompt starts with, serialized stably so that a follow-up (the next chat turn,
another question on the same document) shares a prefix with what came before.

The router never tokenizes or renders the chat template: two requests whose serializations share a
prefix share one in tokens too, which is all the affinity index needs.
"""

from __future__ import annotations

import json
from typing import Any


def request_text(path: str, body: dict[str, Any]) -> str:
    """The prompt of a /v1/completions body, or the messages of a /v1/chat/completions body."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(_message_text(m) for m in messages)
    return _stable_text(body.get("prompt", ""))


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return _stable_text(message)
    return f"<{message.get('role', '')}>\n{_content_text(message.get('content'))}\n"


def _content_text(content: Any) -> str:
    """A string content as is; a list of parts by their text (other parts as JSON)."""
    if isinstance(content, list):
        return "".join(
            part["text"]
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else _stable_text(part)
            for part in content
        )
    return _stable_text(content)


def _stable_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
