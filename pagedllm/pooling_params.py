"""PoolingParams: an embedding request's settings (vLLM's fields).

An embedding request is a prefill with no decode: its prompt runs through the model as any
prompt does (chunked, batched with generation requests, its full blocks shared through the prefix
cache), and where a generation request would sample its first token, the final hidden state of the
prompt's last token (after the final norm: last-token pooling, as Qwen3-Embedding and vLLM's
decoder embedding models pool) is the request's output, and the request ends.

A scoring request (a reranker's) reads the same position through the LM head instead: a
Qwen3-Reranker-style model answers "yes" or "no" to whether a document fits a query, and the score
is the probability of "yes" over the two (`score_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm import limits


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the vector's first N values (Matryoshka-trained models, Qwen3-Embedding's
    32-1024), then normalize; None keeps all. `normalize`: scale to unit L2 norm (cosine
    similarity becomes a dot product), as the models are trained to be used."""

    dimensions: int | None = None
    normalize: bool = True
    score_tokens: tuple[int, int] | None = None
    """(no, yes) token ids: the output is [P(yes)] from the last position's logits of the two."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or not 1 <= self.dimensions <= limits.INT32_MAX
        ):
            raise ValueError(f"dimensions: must be an integer >= 1, got {self.dimensions!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {self.normalize!r}")
        if self.score_tokens is not None and (
            not isinstance(self.score_tokens, tuple)
            or len(self.score_tokens) != 2
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.score_tokens)
        ):
            raise ValueError(f"score_tokens: must be two token ids (no, yes), got {self.score_tokens!r}")

    def score(self, last_logits: torch.Tensor) -> list[float]:
        """last_logits: the prompt's last position's logits, [vocab_size]."""
        assert self.score_tokens is not None
        pair = last_logits.float()[list(self.score_tokens)]
        return [float(torch.softmax(pair, dim=-1)[1])]

    def pool(self, last_hidden: torch.Tensor) -> list[float]:
        """last_hidden: the prompt's last token's final (normed) hidden state, [hidden_size]."""
        vector = last_hidden.float()[: self.dimensions]
        if self.normalize:
            vector = F.normalize(vector, dim=-1)
        return vector.tolist()
