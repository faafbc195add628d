"""Chat templates, rendered in Jinja's sandbox within a time budget and an output bound.

A chat template is a program, and it comes from the model file (or, with
--trust-request-chat-template, from a client): untrusted input. It runs in Jinja's immutable
sandbox (no attribute tricks, no mutation of the inputs, `range` capped), with the globals Hugging
Face chat templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text), and within two bounds, so that no template can hold a thread or the process's memory:

- time: the deadline is checked at every call, attribute or item lookup, operator, filter, loop
  item and output chunk; a template that runs too long stops with TemplateTimeoutError.
- size: `max_chars`, the longest prompt the model can take (max_model_len times the most
  characters a token holds). The output is rendered chunk by chunk and stops once past it; and
  every step that could build a long string in one Python call (`%` and `format` widths,
  `center`, `indent`, `wordwrap`, `replace`, `join`, `lipsum`, repetition, `~` and `+`, the
  stringifying of a large structure, the str methods `ljust`, `zfill`...) is estimated first and
  refused with TemplateSizeError when its result would be over the bound. Estimates are of the
  right order (escapes and repr quotes may add a small factor), never a whole allocation.

Rendering equals transformers' apply_chat_template for the templates we serve (tested).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import types
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import make_attrgetter
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import _PassArg, generate_lorem_ipsum
from markupsafe import Markup

from pagedllm import limits

MAX_INT_BITS = 4096
"""Largest integer `*` and `**` may build (a chat template counts, it does not do number theory)."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "add_generation_prompt", "chat_template", "tools", "documents",
     "tokenize", "continue_final_message", "return_dict", "return_tensors",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length"}
)  # fmt: skip
"""Names a request's chat_template_kwargs may not set: the renderer's own arguments."""

_CONTAINERS = (list, tuple, dict, set, frozenset)
_OPAQUE_CHARS = 80
"""About how long the repr of an object not walked is (a number, a function, a loop)."""
_PRINTF_SPEC = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.DOTALL)


class TemplateTimeoutError(ValueError):
    """The template ran past its time budget."""


class TemplateSizeError(ValueError):
    """The template built, or was about to build, text over its bound."""


class _Budget(threading.local):
    """The rendering thread's deadline and bound (renders run on several threads at once)."""

    at: float | None = None
    seconds: float | None = None
    max_chars: int = limits.MAX_CHAT_TEMPLATE_CHARS


class _BudgetedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with three holes closed: a `{% for %}` checks the deadline at every
    item (a body without calls or lookups would never check it); `~` is measured before it joins
    (it compiles to a bare str join, which no sandbox hook sees); and a block's output (a macro,
    `{% set %}...{% endset %}`) is counted as it is buffered, not only when it is joined."""

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        budgeted = nodes.Call(nodes.EnvironmentAttribute("budgeted_iter"), [node.iter], [], None, None)
        loop = nodes.For(node.target, budgeted, node.body, node.else_, node.test, node.recursive)
        loop.set_lineno(node.lineno).set_environment(self.environment)
        super().visit_For(loop, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.join_checked(context.eval_ctx.autoescape, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, checking the rendering thread's deadline and size bound."""

    code_generator_class = _BudgetedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            finalize=self._check_output,
        )
        self.budget = _Budget()
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["namespace"] = _Namespace
        self.globals["lipsum"] = self._lipsum

    # ---- the deadline and the bound ----

    def check_deadline(self) -> None:
        if self.budget.at is not None and time.monotonic() > self.budget.at:
            raise TemplateTimeoutError(
                f"messages: the chat template ran past its time budget of {self.budget.seconds:g} s"
            )

    def check_size(self, num_chars: int, what: str) -> None:
        """TemplateSizeError if `what` (about `num_chars` characters) is over the bound."""
        if num_chars > self.budget.max_chars:
            self._refuse(f"{what} of about {num_chars:,} characters")

    def _refuse(self, what: str) -> NoReturn:
        raise TemplateSizeError(
            f"messages: the chat template would build {what}, over the {self.budget.max_chars:,} that "
            "bound a prompt of this model (max_model_len times the characters a token holds); a "
            "chat template may not build text that long"
        )

    def size_of(self, value: Any, per_item: int = 2, per_level: int = 0) -> int:
        """About the length of str(value), or of its JSON (_text_size)."""
        if isinstance(value, str | bytes):
            return len(value)
        return _text_size(value, self.budget.max_chars, per_item, per_level)

    def budgeted_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """What every `{% for %}` iterates: its items, checking the deadline at each."""
        for item in iterable:
            self.check_deadline()
            yield item

    def new_buffer(self) -> _Buffer:
        return _Buffer(self)

    def join_checked(self, autoescape: bool, parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ c`, measured before it is joined."""
        self.check_deadline()
        self.check_size(sum(self.size_of(part) for part in parts), "a `~` concatenation")
        return markup_join(parts) if autoescape else str_join(parts)

    def concat(self, parts: Iterable[str]) -> str:
        """The join of a buffered block (`{% set %}`, a macro, `{% filter %}`), measured first."""
        parts = list(parts)
        self.check_deadline()
        self.check_size(sum(len(part) for part in parts), "a block")
        return "".join(parts)

    def _check_output(self, value: Any) -> Any:
        self.check_deadline()
        if not isinstance(value, str):  # a str is already within the bound; a structure may not be
            self.check_size(self.size_of(value), "an output")
        return value

    # ---- the sandbox's hooks ----

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.check_deadline()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str | bytes):
            args = __self._check_str_method(owner, __obj.__name__, args)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, _CONTAINERS):
            __self.check_size(__self.size_of(result), f"the result of {getattr(__obj, '__name__', 'a call')}")
        return result

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
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept fast
            if len(left) + len(right) > self.budget.max_chars:
                self.check_size(len(left) + len(right), "a `+` concatenation")
            return left + right
        if operator == "%" and isinstance(left, str):
            self._check_printf(left, right)
        elif operator == "+" and not isinstance(left, int | float):
            self.check_size(self.size_of(left) + self.size_of(right), "a `+` concatenation")
        elif operator == "*":
            self._check_product(left, right)
        elif operator == "**" and _is_big_power(left, right):
            raise jinja2.exceptions.SecurityError(
                f"exponents over 64 and powers over {MAX_INT_BITS} bits are not allowed in chat templates"
            )
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` and `format_map`, through a formatter that measures each field."""
        is_method = isinstance(value, types.MethodType | types.BuiltinMethodType)
        if not is_method or value.__name__ not in ("format", "format_map"):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        formatter: SandboxedFormatter = (
            _EscapeFormatter(self, escape=owner.escape) if isinstance(owner, Markup) else _Formatter(self)
        )

        def format_(*args: Any, **kwargs: Any) -> str:
            if value.__name__ == "format_map":
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                kwargs, args = args[0], ()
            return type(owner)(formatter.vformat(owner, args, kwargs))

        return functools.update_wrapper(format_, value)

    # ---- what allocates ----

    def _check_product(self, left: Any, right: Any) -> None:
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise jinja2.exceptions.SecurityError(
                    f"products over {MAX_INT_BITS} bits are not allowed in chat templates"
                )
            return
        sequence, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and isinstance(sequence, str | bytes | list | tuple):
            self.check_size(self.size_of(sequence) * count, "a repetition")

    def check_format_spec(self, spec: str) -> None:
        """A width or precision over the bound is refused before it pads or prints."""
        widths = [int(digits) for digits in re.findall(r"\d+", spec)]
        if widths and max(widths) > self.budget.max_chars:
            self._refuse(f"a field {max(widths):,} characters wide (the format spec {spec[:40]!r})")

    def _check_printf(self, fmt: str, values: Any) -> None:
        """`fmt % values`: every width and precision bounded, and the result estimated."""
        total, index = len(fmt), 0
        for match in _PRINTF_SPEC.finditer(fmt):
            key, width, precision, kind = match.groups()
            if kind == "%":
                continue
            if width == "*" or precision == "*":
                raise jinja2.exceptions.SecurityError("`*` widths in % formatting are not allowed")
            self.check_format_spec(f"{width or ''}.{precision or ''}")
            if key is not None and isinstance(values, Mapping):
                value = values.get(key)
            elif isinstance(values, tuple):
                value = values[index] if index < len(values) else None
            else:
                value = values
            index += 1
            total += int(width or 0) + int(precision or 0) + self.size_of(value)
            self.check_size(total, "a % formatting")

    def _check_str_method(self, owner: str | bytes, name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The str (and bytes) methods whose result can be far longer than the string; `join`'s
        items are taken from their iterator first (returned as the call's new arguments)."""
        size = len(owner)
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            self.check_size(max(size, args[0]), f"`{name}`")
        elif name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            tabs = owner.count("\t") if isinstance(owner, str) else owner.count(b"\t")
            self.check_size(size + tabs * tab, "`expandtabs`")
        elif name == "join" and args:
            items = list(args[0])
            self.check_size(sum(map(self.size_of, items)) + len(items) * size, "`join`")
            args = (items, *args[1:])
        elif name == "replace" and len(args) >= 2:
            count = args[2] if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0 else None
            self.check_size(_replaced_size(owner, args[0], args[1], count), "`replace`")
        elif name == "translate" and args:
            table = args[0]
            longest = max(map(self.size_of, table.values()), default=1) if isinstance(table, Mapping) else 1
            self.check_size(size * longest, "`translate`")
        return args

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        """Jinja's lorem ipsum, `n` paragraphs of up to `max` words (about 8 characters each)."""
        self.check_size(n * max * 8, "`lipsum`")
        return generate_lorem_ipsum(n, html, min, max)

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` checking the deadline, estimating its result first where it can be long, and
        measuring a structure it returns."""
        skip = 0 if _PassArg.from_obj(func) is None else 1
        estimate = _FILTER_SIZES.get(name)

        @functools.wraps(func)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.check_deadline()
            if name in _MATERIALIZED and len(args) > skip and not isinstance(args[skip], str):
                args = (*args[:skip], list(args[skip]), *args[skip + 1 :])
                if name in ("join", "sum") and kwargs.get("attribute") is not None:
                    get = make_attrgetter(self, kwargs.pop("attribute"))
                    args = (*args[:skip], [get(item) for item in args[skip]], *args[skip + 1 :])
            if len(args) > skip:
                if name in _STRINGIFYING and not isinstance(args[skip], str):
                    self.check_size(self.size_of(args[skip]), f"the text of `{name}`'s argument")
                if estimate is not None:
                    self.check_size(estimate(self, *args[skip:], **kwargs), f"`{name}`")
            result = func(*args, **kwargs)
            if isinstance(result, _CONTAINERS):
                self.check_size(self.size_of(result), f"the result of `{name}`")
            return result

        return bounded


def _is_big_power(base: Any, exponent: Any) -> bool:
    if not isinstance(base, int) or not isinstance(exponent, int):
        return False
    return exponent > 64 or base.bit_length() * exponent > MAX_INT_BITS


def _count(value: Any, default: int = 0) -> int:
    """An argument that should be a count, as one (a bad one is left to the filter to refuse)."""
    return value if isinstance(value, int) else default


def _replaced_size(text: Any, old: Any, new: Any, count: int | None) -> int:
    if not isinstance(text, str | bytes) or not isinstance(new, str | bytes) or type(old) is not type(text):
        return len(text) if isinstance(text, str | bytes) else 0
    haystack: Any = text  # str or bytes, as `old` is
    matches = haystack.count(old) if old else len(text) + 1
    return len(text) + min(matches, count if count is not None else matches) * len(new)


def _printf_size(env: _BudgetedSandbox, value: Any, *args: Any, **kwargs: Any) -> int:
    env._check_printf(str(value), kwargs or args)
    return 0


def _indent_size(env: _BudgetedSandbox, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    text = str(s)
    pad = len(width) if isinstance(width, str) else _count(width)
    return len(text) + (text.count("\n") + 1) * pad


def _wordwrap_size(
    env: _BudgetedSandbox,
    s: Any,
    width: Any = 79,
    break_long_words: bool = True,
    wrapstring: Any = None,
    **_: Any,
) -> int:
    text, per_line = str(s), len(wrapstring) if isinstance(wrapstring, str) else 2
    num_lines = (
        len(text) // max(1, _count(width, 1)) + text.count(" ") + text.count("\n") + text.count("-") + 1
    )
    return len(text) + num_lines * per_line


def _tojson_size(
    env: _BudgetedSandbox,
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    **_: Any,
) -> int:
    pad = len(indent) if isinstance(indent, str) else _count(indent)
    seps = sum(map(len, separators)) if isinstance(separators, tuple | list) else 2
    return env.size_of(x, per_item=1 + seps + (1 if indent is not None else 0), per_level=pad)


_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "format": _printf_size,
    "center": lambda env, value, width=80: max(len(str(value)), _count(width)),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "truncate": lambda env, s, length=255, killwords=False, end="...", *a, **k: len(str(s)) + len(str(end)),
    "replace": lambda env, s, old, new, count=None: _replaced_size(str(s), str(old), str(new), count),
    "join": lambda env, value, d="", attribute=None: sum(map(env.size_of, value)) + len(value) * len(str(d)),
    "sum": lambda env, value, attribute=None, start=0: sum(map(env.size_of, [start, *value])),
    "batch": lambda env, value, linecount, fill_with=None: 0 if fill_with is None else _count(linecount),
    "slice": lambda env, value, slices, fill_with=None: _count(slices),
    "tojson": _tojson_size,
    "pprint": lambda env, value: env.size_of(value, per_item=3, per_level=1),
}
"""Filters whose result can be far longer than their argument: its size, before they build it."""

_STRINGIFYING = frozenset(
    {"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower", "replace",
     "safe", "string", "striptags", "title", "trim", "truncate", "upper", "urlencode", "urlize",
     "wordcount", "wordwrap", "xmlattr", "reverse", "list", "sort", "unique", "dictsort"}
)  # fmt: skip
"""Filters that turn their argument into text (or a new structure): it is measured first."""
_MATERIALIZED = frozenset({"join", "sum"})
"""Filters whose items are taken from their iterator first, to be measured."""


def _text_size(value: Any, limit: int, per_item: int = 2, per_level: int = 0) -> int:
    """About how many characters str(value) (or json.dumps, given its separators and indent) has,
    found by walking the structure without building any text; the walk stops once past `limit`
    (the answer is then some number over it). Each item costs at least a character, so the walk
    is bounded by `limit` however the structure shares or nests its parts."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, _Namespace):
            item = object.__getattribute__(item, "_Namespace__attrs")
        if isinstance(item, str | bytes):
            total += len(item) + (2 if depth else 0)  # quoted inside a structure
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, Mapping | ItemsView):
            total += 2
            for key, entry in item.items() if isinstance(item, Mapping) else item:
                stack += ((key, depth + 1), (entry, depth + 1))
                total += per_item + 2 + per_level * (depth + 1)
                if total > limit:
                    return total
        elif isinstance(item, list | tuple | set | frozenset | KeysView | ValuesView):
            total += 2
            for entry in item:
                stack.append((entry, depth + 1))
                total += per_item + per_level * (depth + 1)
                if total > limit:
                    return total
        else:
            total += _OPAQUE_CHARS
        if total > limit:
            return total
    return total


class _Buffer(list[str]):
    """A block's output so far, within the bound and the deadline at every piece."""

    def __init__(self, env: _BudgetedSandbox) -> None:
        super().__init__()
        self.env, self.num_chars = env, 0

    def append(self, piece: str) -> None:
        self.num_chars += len(piece)
        self.env.check_size(self.num_chars, "a block")
        self.env.check_deadline()
        super().append(piece)

    def extend(self, pieces: Iterable[str]) -> None:
        for piece in pieces:
            self.append(piece)


class _Measuring:
    """str.format's formatter, measuring each field before formatting it and all of them together."""

    _env: Any  # the _BudgetedSandbox (SandboxedFormatter's)
    _num_chars = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._num_chars = len(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._env.check_deadline()
        self._env.check_format_spec(format_spec)
        widths = [int(digits) for digits in re.findall(r"\d+", format_spec)]
        self._num_chars += self._env.size_of(value) + max(widths, default=0)
        self._env.check_size(self._num_chars, "a str.format")
        return super().format_field(value, format_spec)  # type: ignore[misc]


class _Formatter(_Measuring, SandboxedFormatter):
    pass


class _EscapeFormatter(_Measuring, SandboxedEscapeFormatter):
    pass


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
    time_budget: float | None = limits.CHAT_TEMPLATE_TIME_BUDGET_S,
    max_chars: int | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` with `template`, as transformers' apply_chat_template does (`tools`,
    when given, is the template's `tools` variable).

    time_budget: seconds the render may take (None: no limit). max_chars: the longest text it may
    build, the rendered prompt and each step towards it (None: limits.MAX_CHAT_TEMPLATE_CHARS).
    Raises ValueError for a template that fails: TemplateTimeoutError past the budget,
    TemplateSizeError past the bound; jinja2's errors, the template's own raise_exception and
    running out of memory become ValueError too.
    """
    kwargs = template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs: may not set {', '.join(reserved)}")
    env = _environment()
    budget = env.budget
    budget.at = None if time_budget is None else time.monotonic() + time_budget
    budget.seconds = time_budget
    budget.max_chars = limits.MAX_CHAT_TEMPLATE_CHARS if max_chars is None else max_chars
    tools_var = {} if tools is None else {"tools": tools}
    chunks: Iterator[str] | None = None
    try:
        chunks = _compile(template).generate(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **tools_var,
            **kwargs,
        )
        pieces, num_chars = [], 0
        for chunk in chunks:
            num_chars += len(chunk)
            env.check_size(num_chars, "a prompt")
            env.check_deadline()
            pieces.append(chunk)
        return "".join(pieces)
    except (TemplateTimeoutError, TemplateSizeError):
        raise
    except jinja2.TemplateError as error:
        raise ValueError(f"messages: the chat template failed: {error}") from error
    except MemoryError:
        raise ValueError("messages: the chat template ran out of memory") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as error:
        raise ValueError(f"messages: the chat template failed: {type(error).__name__}: {error}") from error
    finally:
        if chunks is not None:
            chunks.close()  # type: ignore[attr-defined]
        budget.at = None


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
