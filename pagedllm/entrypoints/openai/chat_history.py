"""--truncate-chat-history: a conversation too long for max_model_len loses its oldest turns (never
its system messages or its last message) instead of getting a 400.

The work is bounded, however long the conversation, since it runs on the tokenizer thread that
every request shares (a search that rendered the whole conversation at each step once held it
for 84 s on one 3.5 MB request):

    1. the messages always kept, bounded by their size in characters  -> 400 before tokenizing
    2. every message's text tokenized once, in one batch              -> 400 if those kept are over
    3. the whole conversation rendered, only if its texts may fit     -> done if it fits
    4. the cut read off the cached counts, checked by rendering what is kept (a prompt about
       max_model_len long); a wrong estimate moves the cut on: at most MAX_RENDERS renders
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.serving_common import check_prompt_chars

MAX_RENDERS = 3
"""Renders of a cut conversation: the estimate is off by the template's tokens at most."""

Render = Callable[[list[ChatMessage]], Awaitable[dict[str, Any]]]
CountTokens = Callable[[list[str]], Awaitable[list[int]]]


@dataclass(frozen=True)
class HistoryCut:
    """What was dropped from a conversation: reported in its usage."""

    messages: int
    tokens: int
    """Estimated from the per-message counts when the whole conversation was not rendered."""


async def fit_history(
    messages: list[ChatMessage],
    texts: list[str],
    room: int,
    *,
    render: Render,
    count_tokens: CountTokens,
    max_chars_per_token: int | None,
) -> tuple[dict[str, Any], HistoryCut | None]:
    """The rendered prompt of at most `room` tokens that drops the fewest oldest turns (as far as
    the estimate tells), and what it dropped (None: nothing). `texts`: each message's text as the
    template gets it. Raises ValueError (messages) when what must stay does not fit."""
    first = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    kept_always = sorted({*range(first), len(messages) - 1})
    check_prompt_chars("messages", sum(len(texts[i]) for i in kept_always), room, max_chars_per_token)
    counts = await count_tokens(texts)
    num_kept_always = sum(counts[i] for i in kept_always)
    if num_kept_always > room:
        raise ValueError(
            f"messages: the system messages and the last message alone are {num_kept_always:,} "
            f"tokens, over the {room:,} that max_model_len leaves after max_tokens; shorten them"
        )
    overhead = 0.0  # the template's tokens per message, learned from each render
    num_full: int | None = None
    if sum(counts) <= room:
        prompt = await render(messages)
        num_full = len(prompt["prompt_token_ids"])
        if num_full <= room:
            return prompt, None
        overhead = (num_full - sum(counts)) / len(messages)
    start = first - 1
    for _ in range(MAX_RENDERS):
        kept_from = _first_kept(messages, counts, first, room, overhead, after=start)
        if kept_from is None:
            break
        start = kept_from
        kept = messages[:first] + messages[start:]
        candidate = await render(kept)
        num_kept = len(candidate["prompt_token_ids"])
        num_content = sum(counts[:first]) + sum(counts[start:])
        overhead = max(overhead, (num_kept - num_content) / len(kept))
        if num_kept <= room:
            full = num_full if num_full is not None else round(sum(counts) + overhead * len(messages))
            return candidate, HistoryCut(start - first, max(0, full - num_kept))
    raise ValueError(
        f"messages: dropping the oldest turns left no prompt within the {room:,} tokens that "
        "max_model_len leaves after max_tokens; shorten the system messages or the last message"
    )


def _first_kept(
    messages: list[ChatMessage], counts: list[int], first: int, room: int, overhead: float, *, after: int
) -> int | None:
    """The first message kept after the system messages: the earliest index past `after` that
    opens a user turn (a reply whose question went is dropped too), or the last message, whose
    estimate fits `room`. None when only the last message remains and has been tried."""
    last = len(messages) - 1
    system = sum(counts[:first]) + overhead * first
    kept_tokens = system + sum(counts[after + 1 :]) + overhead * (last - after)
    for start in range(after + 1, last + 1):
        if start > after + 1:
            kept_tokens -= counts[start - 1] + overhead
        opens_turn = messages[start].role == "user" or start == last
        if opens_turn and kept_tokens <= room:
            return start
    return last if after < last else None
