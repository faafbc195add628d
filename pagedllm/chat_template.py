"""Chat templates, rendered in Jinja's sandbox with a time budget.

A chat template is a program. The tokenizer's own (or --chat-template) is the operator's
choice; a template sent by a client runs only where the operator allows it
(--trust-request-chat-template). Either way it runs in Jinja's immutable sandbox (no attribute
tricks, no mutation of the inputs, `range` capped), with the globals Hugging Face chat templates
expect (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), and under a
deadline: every call, attribute or item lookup checks it, so a template that loops for too long
stops with TemplateTimeoutError instead of holding a thread. Repetition (`'x' * n`) is capped too.
Rendering equals transformers' apply_chat_template for the templates we serve (tested).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT_LENGTH = 1_000_000
"""Longest string or list `*` may build inside a template."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "add_generation_prompt", "chat_template", "tools", "documents",
     "tokenize", "continue_final_message", "return_dict", "return_tensors",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length"}
)  # fmt: skip
"""Names a request's chat_template_kwargs may not set: the renderer's own arguments."""


class TemplateTimeoutError(ValueError):
    """The template ran past its time budget."""


class _Deadline(threading.local):
    at: float | None = None
    budget: float | None = None


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, checking the rendering thread's deadline at every call and lookup."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.deadline = _Deadline()
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["namespace"] = _Namespace

    def check_deadline(self) -> None:
        if self.deadline.at is not None and time.monotonic() > self.deadline.at:
            raise TemplateTimeoutError(
                f"messages: the chat template ran past its time budget of {self.deadline.budget:g} s"
            )

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check_deadline()
        return super().getitem(obj, argument)

    def call_filter(self, *args: Any, **kwargs: Any) -> Any:
        self.check_deadline()
        return super().call_filter(*args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.check_deadline()
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise jinja2.exceptions.SecurityError("exponents over 64 are not allowed in chat templates")
        if operator == "*":
            sequence, count = (left, right) if isinstance(right, int) else (right, left)
            is_repeat = isinstance(sequence, str | list | tuple) and isinstance(count, int)
            if is_repeat and len(sequence) * count > MAX_REPEAT_LENGTH:
                raise jinja2.exceptions.SecurityError(
                    f"repetition longer than {MAX_REPEAT_LENGTH:,} items is not allowed in chat templates"
                )
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@functools.cache
def _environment() -> _BudgetedSandbox:
    return _BudgetedSandbox()


def render(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, Any],
    template_kwargs: dict[str, Any] | None = None,
    time_budget: float | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` with `template`, as transformers' apply_chat_template does (`tools`,
    when given, is the template's `tools` variable).

    Raises ValueError (TemplateTimeoutError past `time_budget` seconds) for a template that
    fails; jinja2's errors and the template's own raise_exception become ValueError too.
    """
    kwargs = template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs: may not set {', '.join(reserved)}")
    deadline = _environment().deadline
    deadline.at = None if time_budget is None else time.monotonic() + time_budget
    deadline.budget = time_budget
    try:
        tools_var = {} if tools is None else {"tools": tools}
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **tools_var,
            **kwargs,
        )
    except TemplateTimeoutError:
        raise
    except jinja2.TemplateError as error:
        raise ValueError(f"messages: the chat template failed: {error}") from error
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as error:
        raise ValueError(f"messages: the chat template failed: {type(error).__name__}: {error}") from error
    finally:
        deadline.at = None


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no way to reach Python internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace may not hold {name!r} (underscore names)")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
