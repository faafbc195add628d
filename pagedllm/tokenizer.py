"""Tokenizer loading (transformers' AutoTokenizer, local files only) and chat prompts.

`chat_prompt` is the one place a conversation becomes a prompt (text and token ids), for the
offline API, the server and the benchmarks alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from pagedllm import chat_template, limits

# Files transformers builds a tokenizer from: a serialized fast tokenizer, a SentencePiece model
# (converted to a fast one through the sentencepiece package), or a BPE vocabulary with its config.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    folder: str | Path, chat_template_text: str | None = None, *, named_class: bool = False
) -> PreTrainedTokenizerBase:
    """The folder's fast tokenizer. Checked here because transformers, given none of its files,
    answers with advice to install sentencepiece or tiktoken, which does not help.

    named_class: load it with the tokenizer class its tokenizer_config.json names (a folder
    pagedllm wrote, whose saved class is the one AutoTokenizer picks), not through AutoTokenizer,
    which reads the model's config to choose a class and imports much of transformers to do so."""
    folder = Path(folder)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no {' / '.join(TOKENIZER_FILES)} in {folder}; copy the tokenizer files of the model "
            "there, or pass --tokenizer with a folder or hub name that has them"
        )
    loader: Any = None
    if named_class:  # a class transformers exports: its lazy import reads that module alone
        class_name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
        named = getattr(transformers, str(class_name), None)
        if isinstance(named, type) and issubclass(named, PreTrainedTokenizerBase):
            loader = named
    if loader is None:  # imports transformers.models' index of every model: here only
        from transformers import AutoTokenizer

        loader = AutoTokenizer
    tokenizer = loader.from_pretrained(str(folder), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{folder}: pagedllm needs a fast (tokenizers-backed) tokenizer")
    if chat_template_text is not None:
        path = Path(chat_template_text)
        tokenizer.chat_template = path.read_text() if path.is_file() else chat_template_text
    return tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    time_budget: float | None = limits.CHAT_TEMPLATE_TIME_BUDGET_S,
    max_chars: int | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as text, through `template` or else the tokenizer's chat template, within
    `time_budget` seconds and `max_chars` characters (see chat_template.render; max_prompt_chars
    gives a model's bound)."""
    template = template if template is not None else tokenizer.chat_template
    if not template:
        raise ValueError("messages: this model's tokenizer has no chat template; pass --chat-template")
    return chat_template.render(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tokenizer.special_tokens_map,
        template_kwargs=template_kwargs,
        time_budget=time_budget,
        max_chars=max_chars,
        tools=tools,
    )


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **render_kwargs: Any,
) -> dict[str, Any]:
    """{"prompt": text, "prompt_token_ids": ids} for a conversation. The rendered text already
    holds the special tokens, so it is tokenized without adding more."""
    return tokenize_rendered(
        tokenizer, render_chat(tokenizer, messages, add_generation_prompt, **render_kwargs)
    )


def tokenize_rendered(tokenizer: PreTrainedTokenizerBase, text: str) -> dict[str, Any]:
    """chat_prompt's answer for a conversation rendered to `text`."""
    if not text:
        raise ValueError("messages: the chat template rendered an empty prompt")
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def workload_prompts(tokenizer: PreTrainedTokenizerBase, workload: list[Any]) -> list[list[int]]:
    """Token ids of a request set's prompts (pagedllm/workload.py): a single-turn request's
    text as the engine tokenizes it; a conversation's first turn through the chat template (later
    turns hold the model's answers, which a file does not have)."""
    prompts = []
    for item in workload:
        if hasattr(item, "turns"):
            messages = [{"role": "system", "content": item.system}] if item.system else []
            messages.append({"role": "user", "content": item.turns[0]})
            prompts.append(chat_prompt(tokenizer, messages)["prompt_token_ids"])
        else:
            prompts.append(tokenizer(item.prompt).input_ids)
    return prompts


def workload_turns(
    tokenizer: PreTrainedTokenizerBase, workload: list[Any]
) -> list[tuple[list[int], list[int]]]:
    """Every request a workload sends as `pagedllm bench prefix` and `bench serve` send them: one
    per single-turn line, one per turn of a conversation (the history before it, answers
    included). Each comes as (prompt ids, ids the engine holds once it is answered: the prompt and
    the answer but its last token). The model's answers are not known without running it, so each
    stands in as `max_tokens` tokens of filler, the length the benchmarks cap them at."""
    turns = []
    for item in workload:
        if not hasattr(item, "turns"):
            prompt_ids = tokenizer(item.prompt).input_ids
            turns.append((prompt_ids, prompt_ids))
            continue
        messages = [{"role": "system", "content": item.system}] if item.system else []
        answer_ids = tokenizer(" ok" * item.max_tokens, add_special_tokens=False).input_ids[: item.max_tokens]
        answer = tokenizer.decode(answer_ids)
        for user_turn in item.turns:
            messages.append({"role": "user", "content": user_turn})
            prompt_ids = chat_prompt(tokenizer, messages)["prompt_token_ids"]
            turns.append((prompt_ids, prompt_ids + answer_ids[:-1]))
            messages.append({"role": "assistant", "content": answer})
    return turns


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of text one token can stand for: its longest vocabulary entry (a
    byte-level entry has a character per byte). None where a normalizer may fold any number of
    characters into one token (collapsed spaces, dropped control characters): no bound then."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    return max(map(len, tokenizer.get_vocab()))


def max_prompt_chars(max_model_len: int, max_chars_per_token: int | None) -> int:
    """The most characters a chat template may render for a model (its output bound): a prompt of
    max_model_len tokens holds no more, so a longer one is refused before it is tokenized.
    max_chars_per_token: max_token_chars's answer (None: limits.CHARS_PER_TOKEN_FALLBACK); the
    bound is at most limits.MAX_CHAT_TEMPLATE_CHARS."""
    per_token = limits.CHARS_PER_TOKEN_FALLBACK if max_chars_per_token is None else max_chars_per_token
    return min(max_model_len * per_token, limits.MAX_CHAT_TEMPLATE_CHARS)
