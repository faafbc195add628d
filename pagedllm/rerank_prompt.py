"""The prompt a yes/no reranker reads (Qwen3-Reranker's format, from its model card), and the two
tokens it answers with: each (query, document) pair is one prompt; its score is P("yes") over
"yes" and "no" at the prompt's last position (pooling_params.py's score_tokens)."""

from __future__ import annotations

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
