"""What one request may carry, in one place: every limit here is checked before a request
reaches the engine thread (and again by LLMEngine.add_request for the offline API), and a
request over one gets a ValueError naming the field, which the server turns into a 400.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_N = 128
"""Most choices per prompt (OpenAI's own limit for `n`)."""
MAX_CHOICES = 1024
"""Most sequences one API request may start (prompts x n)."""
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""OpenAI's bounds for a logit bias."""
MAX_USER_CHARS = 256
"""The caller's name (`user`), which statistics and /metrics labels carry."""
MAX_CACHE_SALT_CHARS = 1024
INT64_RANGE = (-(2**63), 2**63 - 1)
"""Seeds (vLLM's range: a torch.long)."""
INT32_MAX = 2**31 - 1
"""top_k and other counts a kernel may hold in 32 bits."""
MAX_GRAMMAR_SPEC_CHARS = 64 * 1024
"""A JSON schema, regex, EBNF grammar or choice list (as text): compiling one is work off the
engine thread, but work nonetheless."""
MAX_GRAMMAR_DEPTH = 64
"""Deepest nesting of objects and lists in a JSON schema, whether sent as an object or as text,
counted through each `$ref` as the definition it points to: a compile's cost grows steeply with
depth (450 levels: tens of seconds, whether nested in the text or chained through $defs)."""
MAX_GRAMMAR_EXPANDED_NODES = 100_000
"""Most objects and lists in a JSON schema once each `$ref` is written out as its definition: a
64 KB text holds ~20,000 at most; a diamond of references (each definition referring twice to
the next) doubles with every level and is refused here, measured without being written out."""
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
"""A grammar that takes longer to compile is refused, and its compile process killed."""
GRAMMAR_COMPILE_WORKERS = 2
"""Compile processes: one compile that runs to its timeout holds up the others for none of it."""
MAX_COMPILED_GRAMMAR_BYTES = 16 * 1024**2
"""A compiled grammar's memory (its per-state token masks): a larger one is refused."""
MAX_CACHED_GRAMMAR_BYTES = 256 * 1024**2
"""Compiled grammars kept for reuse, all together (the least recently used go first)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of lists and objects in a request body."""
TOO_DEEP = f"body: nested deeper than {MAX_JSON_DEPTH} levels"
"""What the server and the router answer past it, whoever notices (this walk or json's recursion)."""
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024**2
"""--max-request-body-bytes: far above any prompt max_model_len allows, far below what hurts."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text_and_depth(body: dict) -> None:
    """Walk a request body (iteratively: no recursion limit to hit) for lone surrogates and
    nesting deeper than MAX_JSON_DEPTH; ValueError naming the place. The server and the router
    both run it, so both answer alike."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise ValueError(TOO_DEEP)
        if isinstance(value, str):
            if not is_valid_text(value):
                where = ".".join(path) or "body"
                message = f"{where}: holds a lone surrogate (e.g. \\ud800), which is not valid Unicode"
                raise ValueError(message)
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((str(key), path))
                stack.append((item, (*path, str(key))))
        elif isinstance(value, list):
            stack.extend((item, (*path, str(index))) for index, item in enumerate(value))


def is_valid_text(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON allows the escape; UTF-8 cannot encode it)."""
    return text.isascii() or _SURROGATE.search(text) is None


def check_text(name: str, value: str | None, max_chars: int | None = None) -> None:
    """ValueError unless `value` is None or valid text (of at most `max_chars` characters)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a string")
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"{name}: {len(value):,} characters is over the limit of {max_chars:,}")
    if not is_valid_text(value):
        raise ValueError(f"{name}: holds a lone surrogate (e.g. \\ud800), which is not valid Unicode")


def check_finite(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")


# ---- chat templates (pagedllm/chat_template.py): a template is untrusted input ----
CHAT_TEMPLATE_TIME_BUDGET_S = 5.0
"""Seconds a chat template may take to render, offline and served (--chat-template-time-budget)."""
MAX_CHAT_TEMPLATE_CHARS = 16 * 1024**2
"""The most characters a chat template may build, whatever max_model_len: the bound where the
model's is not known, and a ceiling on it where it is (16 Mi characters: over 2 million tokens)."""
CHARS_PER_TOKEN_FALLBACK = 64
"""The characters a token is taken to hold, to bound a rendered prompt by max_model_len, where the
tokenizer's normalizer leaves no exact bound (tokenizer.max_token_chars is None): 16 times what
real text averages."""
