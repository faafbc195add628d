"""AsyncTokenizer: the server's tokenization and chat rendering, on threads of their own.

    event loop (HTTP handlers) -- await encode / decode ------> tokenizer threads (TOKENIZER_WORKERS,
                                                                each with its own tokenizer copy)
                               -- await chat_prompt --> template threads (TEMPLATE_WORKERS)
                                                        render, then the tokenizer threads encode
Prompts are rendered and tokenized here, never on the engine thread, so a large body or a slow
template delays its own request, not the decoding of everyone else (the tokenizers library
releases the GIL while it encodes). Chat templates render on threads apart from tokenizing: a
template may run for its whole time budget (seconds), and a bystander's encode must not queue
behind it. A tokenizer object is not safe to share between threads (a call sets its truncation
and padding), so each tokenizer thread has a copy of its own, and none is the engine's (its
detokenizers use their own); rendering only reads the template and the special tokens.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar, cast

from transformers import PreTrainedTokenizerBase

from pagedllm.tokenizer import max_prompt_chars, max_token_chars, render_chat, tokenize_rendered

T = TypeVar("T")

TOKENIZER_WORKERS = 2
"""Threads that encode and decode: a long encode (a prompt of max_model_len) holds one of them."""
TEMPLATE_WORKERS = 2
"""Threads that render chat templates: a template running to its time budget holds one of them."""


class AsyncTokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        template_time_budget: float | None,
        num_workers: int = TOKENIZER_WORKERS,
    ) -> None:
        """template_time_budget: seconds a chat template may take to render (None: no limit).
        num_workers: tokenizer threads; each but the first gets a deep copy of `tokenizer`."""
        self.tokenizer = tokenizer
        self.template_time_budget = template_time_budget
        self.max_chars_per_token = max_token_chars(tokenizer)
        """Bounds a text's tokens from its length before it is tokenized (None: no bound)."""
        self._copies: queue.SimpleQueue[PreTrainedTokenizerBase] = queue.SimpleQueue()
        for index in range(num_workers):
            self._copies.put(tokenizer if index == 0 else copy.deepcopy(tokenizer))
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="pagedllm-tokenizer", initializer=self._take_copy
        )
        self._renderer = ThreadPoolExecutor(
            max_workers=TEMPLATE_WORKERS, thread_name_prefix="pagedllm-template"
        )

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (as the tokenizer's __call__ gives them)."""
        return await self._tokenize(lambda tok: tok(texts, add_special_tokens=add_special_tokens).input_ids)

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        *,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        max_model_len: int | None = None,
    ) -> dict[str, Any]:
        """{"prompt": text, "prompt_token_ids": ids}, rendered within the time budget and, given
        max_model_len, within the characters a prompt that long can hold (else within
        limits.MAX_CHAT_TEMPLATE_CHARS): a longer one is refused before it is tokenized."""
        max_chars = (
            None if max_model_len is None else max_prompt_chars(max_model_len, self.max_chars_per_token)
        )
        render = functools.partial(
            render_chat,
            self.tokenizer,
            messages,
            add_generation_prompt,
            template=template,
            template_kwargs=template_kwargs,
            time_budget=self.template_time_budget,
            max_chars=max_chars,
            tools=tools,
        )
        text = await self._run(self._renderer, render)
        return await self._tokenize(lambda tok: tokenize_rendered(tok, text))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._tokenize(lambda tok: cast(str, tok.decode(token_ids)))  # flat ids: one str

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._renderer.shutdown(wait=False, cancel_futures=True)

    def _take_copy(self) -> None:
        """A tokenizer thread's first act: taking the copy it alone will use."""
        self._local.tokenizer = self._copies.get_nowait()

    async def _tokenize(self, work: Callable[[PreTrainedTokenizerBase], T]) -> T:
        return await self._run(self._executor, lambda: work(self._local.tokenizer))

    async def _run(self, executor: Executor, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, work)
