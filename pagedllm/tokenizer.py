"""Tokenizer loading (transformers' AutoTokenizer, local files only) and prompt rendering."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(folder: str | Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{folder}: pagedllm needs a fast (tokenizers-backed) tokenizer")
    if chat_template is not None:
        path = Path(chat_template)
        tokenizer.chat_template = path.read_text() if path.is_file() else chat_template
    return tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> str:
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; pass --chat-template")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
