"""What a JSON schema must satisfy before it is compiled: bounded nesting, bounded size once its
`$ref`s are expanded, and local references only.

A schema comes as an object (a request body's, whose nesting the server already bounds) or as
text, which can nest as deep as its size allows: the text's depth is measured by a linear scan of
its brackets, so neither json.loads nor anything after it recurses 30,000 levels deep.

Nesting is also measured through `$ref`, as if each definition were written where it is used: a
flat 42 KB text whose 450 `$defs` are objects each referring to the next nests 900 levels that
way, and xgrammar's compiled form of it serializes to ~80 MB (4 s to write in a compile process,
2 s to read back in the server, measured on 2 cores). Each definition is measured once (a memo
by node, so a diamond of references that doubles at each level costs one visit per definition,
not 2**levels); a `$ref` back to a definition it is inside of (a linked list, a tree) is
recursion, which xgrammar compiles as a rule calling itself (in milliseconds), and adds nothing.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

from pagedllm import limits

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")
_FIELD = "structured_outputs.json"
_DEFINITIONS = ("$defs", "definitions")


def parse_json_schema(schema: str | dict[str, Any] | bool) -> dict[str, Any] | bool:
    """The schema as an object. ValueError naming what to change if it is not valid JSON, not a
    schema, refers to another document, nests deeper than limits.MAX_GRAMMAR_DEPTH or holds more
    than limits.MAX_GRAMMAR_EXPANDED_NODES objects and lists (both counted through `$ref`)."""
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
    _check_expanded(schema)
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


def _check_expanded(schema: dict[str, Any] | bool) -> None:
    """Depth and number of objects and lists with every `$ref` written out, without writing them
    out: one post-order walk (an explicit stack: a chain of 2,000 refs recurses nowhere) over the
    schema's tree plus its reference edges, each object or list measured once.

    An object holding `$ref` measures as the larger of itself and its target (which takes its
    place, at its level) and counts the target's nodes. A target on the current path is a cycle:
    a recursive rule to xgrammar, counted as nothing (so a node measured inside a cycle leaves out
    the part of the cycle above it: recursion costs xgrammar a rule, not a level per turn)."""
    if not isinstance(schema, dict):
        return
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (depth, nodes), written out
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        target = _ref_target(node, schema) if isinstance(node, dict) else None
        children = [v for v in _held(node) if isinstance(v, dict | list)]
        if not children_done:
            if key not in measured and key not in on_path:
                on_path.add(key)
                stack.append((node, True))
                stack.extend((child, False) for child in children)
                if target is not None:
                    stack.append((target, False))
            continue
        on_path.discard(key)
        depth, nodes = 1, 1
        for child in children:
            child_depth, child_nodes = measured.get(id(child), (0, 0))
            depth, nodes = max(depth, child_depth + 1), nodes + child_nodes
        if target is not None:  # in the place of the object that refers to it
            target_depth, target_nodes = measured.get(id(target), (0, 0))  # (0, 0): a cycle
            depth, nodes = max(depth, target_depth), nodes + target_nodes
        if depth > limits.MAX_GRAMMAR_DEPTH:
            raise _too_deep(through_ref=True)
        if nodes > limits.MAX_GRAMMAR_EXPANDED_NODES:
            raise ValueError(
                f"{_FIELD}: over {limits.MAX_GRAMMAR_EXPANDED_NODES:,} objects and lists once each $ref "
                "is written out as the definition it points to; refer to fewer or smaller definitions"
            )
        measured[key] = (depth, nodes)


def _held(node: dict[str, Any] | list[Any]) -> Iterable[Any]:
    """What a node holds as part of the grammar: not its definitions, which count where a $ref
    writes them out (and only there; their own nesting is _check_object's)."""
    if isinstance(node, list):
        return node
    return (value for name, value in node.items() if name not in _DEFINITIONS)


def _ref_target(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any] | list[Any] | None:
    """The object or list a local `$ref` ('#', '#/$defs/a~1b', percent-escapes allowed) points
    to; None for none, an anchor ('#name') or a pointer to nothing (xgrammar's own error then)."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        name = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and name in target:
            target = target[name]
        elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
            target = target[int(name)]
        else:
            return None
    return target if isinstance(target, dict | list) else None


def _too_deep(*, through_ref: bool = False) -> ValueError:
    how = " (counting each $ref as the definition it points to, written in its place)" if through_ref else ""
    return ValueError(
        f"{_FIELD}: nested deeper than {limits.MAX_GRAMMAR_DEPTH} levels of objects and lists{how}; "
        "make it shallower"
    )
