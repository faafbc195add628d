"""What a JSON schema must satisfy before it is compiled: bounded nesting and local references only.

A schema comes as an object (a request body's, whose nesting the server already bounds) or as
text, which can nest as deep as its size allows: the text's depth is measured by a linear scan of
its brackets, so neither json.loads nor anything after it recurses 30,000 levels deep.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from pagedllm import limits

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")
_FIELD = "structured_outputs.json"


def parse_json_schema(schema: str | dict[str, Any] | bool) -> dict[str, Any] | bool:
    """The schema as an object. ValueError naming what to change if it is not valid JSON, not a
    schema, nests deeper than limits.MAX_GRAMMAR_DEPTH, or refers to another document."""
    if isinstance(schema, str):
        limits.check_text(_FIELD, schema, limits.MAX_GRAMMAR_SPEC_CHARS)
        _check_text_depth(schema)
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"{_FIELD}: not valid JSON ({error})") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{_FIELD}: a JSON schema is an object")
    _check_object(schema)
    return schema


def _check_text_depth(text: str) -> None:
    """Nesting of the brackets outside string literals (an overestimate for text that is not JSON)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if depth > limits.MAX_GRAMMAR_DEPTH:
        raise _too_deep()


def _check_object(schema: dict[str, Any] | bool) -> None:
    """Depth and `$ref`s of a parsed schema, walked without recursion."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list) and depth > limits.MAX_GRAMMAR_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise ValueError(
                    f"{_FIELD}: $ref {ref[:200]!r} points outside the schema, which is never fetched; "
                    "put the definition under $defs and refer to it as '#/$defs/NAME'"
                )
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def _too_deep() -> ValueError:
    return ValueError(
        f"{_FIELD}: nested deeper than {limits.MAX_GRAMMAR_DEPTH} levels of objects and lists; flatten "
        "it (e.g. with $defs and $ref)"
    )
