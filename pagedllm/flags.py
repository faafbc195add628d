"""Command-line flags from a settings dataclass: one `--flag` per field (`max_num_seqs` ->
`--max-num-seqs`), its argparse shape read from the field's annotation. The annotations are text
(`from __future__ import annotations`), so the shapes go by that text: int and float parse as
such, a list takes one or more values, a Literal alias (named in `literals`) lists its choices,
and a bool gets its `--no-` twin (or, off by default and asked for, is a plain switch)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any, get_args

_TYPES: dict[str, type] = {"int": int, "int | None": int, "float": float, "float | None": float}
_BOOLS = {"bool", "bool | None"}
_LISTS = {"list[str]", "list[str] | None"}


def flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def flag_shape(
    f: dataclasses.Field, literals: Mapping[str, Any], plain_switch: bool = False
) -> dict[str, Any]:
    """argparse's type, action, nargs or choices for the field. `plain_switch`: a bool that is
    False by default is a `store_true` switch without a `--no-` twin."""
    annotation = str(f.type)
    if annotation in _BOOLS:
        switch = plain_switch and f.default is False
        return {"action": "store_true" if switch else argparse.BooleanOptionalAction}
    if annotation in _TYPES:
        return {"type": _TYPES[annotation]}
    if annotation in _LISTS:
        return {"nargs": "+"}
    if annotation in literals:
        return {"choices": list(get_args(literals[annotation]))}
    return {}
