"""AsyncTokenizer: the server's tokenization and chat rendering, on a thread of their own.

    event loop (HTTP handlers)  -- await encode / chat_prompt / decode -->  tokenizer thread
                                                                            (its own tokenizer)
Prompts are rendered and tokenized here, never on the engine thread, so a large body or a
slow template delays its own request, not the decoding of everyone else (the tokenizers
library releases the GIL while it encodes). One worker thread: a tokenizer object is not safe
to share between threads, so this one is not the engine's (its detokenizers use their own).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from transformers import PreTrainedTokenizerBase

from pagedllm.tokenizer import chat_prompt, max_token_chars

T = TypeVar("T")


class AsyncTokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, template_time_budget: float | None) -> None:
        """template_time_budget: seconds a chat template may take to render (None: no limit)."""
        self.tokenizer = tokenizer
        self.template_time_budget = template_time_budget
        self.max_chars_per_token = max_token_chars(tokenizer)
        """Bounds a text's tokens from its length before it is tokenized (None: no bound)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (as the tokenizer's __call__ gives them)."""
        return await self._run(lambda: self.tokenizer(texts, add_special_tokens=add_special_tokens).input_ids)

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        *,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """{"prompt": text, "prompt_token_ids": ids}, rendered within the time budget."""
        build = functools.partial(
            chat_prompt,
            self.tokenizer,
            messages,
            add_generation_prompt,
            template=template,
            template_kwargs=template_kwargs,
            time_budget=self.template_time_budget,
            tools=tools,
        )
        return await self._run(build)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(lambda: cast(str, self.tokenizer.decode(token_ids)))  # flat ids: one str

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)
