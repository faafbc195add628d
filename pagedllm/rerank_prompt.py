"""The prompt a yes/no reranker reads (Qwen3-Reranker's format, from its model card), and the two
tokens it answers with: each (query, document) pair is one prompt; its score is P("yes") over
"yes" and "no" at the prompt's last position (pooling_params.py's score_tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """Qwen3-Reranker's prompt for one pair (its model card's format)."""
    body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return PREFIX + body + SUFFIX


def yes_no_tokens(tokenizer: Any) -> tuple[int, int] | None:
    """The vocabulary's ("no", "yes") token ids, None where it has not both as single tokens."""
    ids = [tokenizer.convert_tokens_to_ids(word) for word in ("no", "yes")]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        return None
    return ids[0], ids[1]


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's /score pairing: one text_1 against each text_2, or pairwise; ValueError otherwise."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"text_1: {len(firsts)} texts against {len(seconds)} in text_2 (one, or as many as text_2)"
        )
    return list(zip(firsts, seconds, strict=True))
