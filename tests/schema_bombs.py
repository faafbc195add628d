"""JSON schemas whose text is flat but whose `$ref`s nest or multiply (issue 45), and recursive
ones that are legitimate, for the schema checks' tests."""

from __future__ import annotations

import json


def ref_chain_schema_text(length: int) -> str:
    """`length` definitions, each an object whose one property refers to the next: flat text
    (450: 42 KB, nesting 4 deep) that nests 2 * `length` objects once its $refs are written out."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}", "description": "x"}}}
        for i in range(length)
    }
    defs[f"d{length}"] = {"type": "string"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def ref_diamond_schema(levels: int, width: int = 2) -> dict:
    """Each definition refers `width` times to the next: width ** levels objects written out."""
    defs: dict = {
        f"d{i}": {
            "type": "object",
            "properties": {f"p{k}": {"$ref": f"#/$defs/d{i + 1}"} for k in range(width)},
        }
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


LINKED_LIST = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["value", "next"],
        }
    },
    "$ref": "#/$defs/node",
}
TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name"],
}
