"""Prefix-cache warm-up (--prefix-cache-warmup): the prompts of a workload file (its conversations'
first turns) computed into the prefix cache, one token each, before the first real request, so
the requests that share them hit. Each front end runs it at start-up through its own request
path (LLMEngine.add_request; AsyncLLM's processor and engine thread)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.tokenizer import workload_prompts
from pagedllm.workload import load_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def warm_up(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    add: Callable[[list[int]], object],
    run_to_end: Callable[[], None],
) -> None:
    """`add(prompt_ids)` queues one prompt (max_tokens 1); `run_to_end()` steps until none is left.

    Raises:
        ValueError: naming --prefix-cache-warmup and the file, when it cannot be read or one of
            its prompts cannot be served (what `add` raised).
    """
    start = time.monotonic()
    try:
        prompts = workload_prompts(tokenizer, load_workload(path))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"prefix_cache_warmup: cannot read {path} ({_describe(error)}); give --prefix-cache-warmup "
            "a JSONL file with a prompt (and max_tokens) or a conversation per line"
        ) from None
    for index, prompt_ids in enumerate(prompts):
        try:
            add(prompt_ids)
        except ValueError as error:
            raise ValueError(
                f"prefix_cache_warmup: {path}, prompt {index + 1}: {error}; fix or drop it"
            ) from None
    run_to_end()
    logger.info(
        "Prefix cache warm-up: %d prompts from %s (%s tokens) in %.1f s",
        len(prompts),
        path,
        f"{sum(map(len, prompts)):,}",
        time.monotonic() - start,
    )


def _describe(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"a line lacks the {error} field"
    return getattr(error, "strerror", None) or str(error) or type(error).__name__
