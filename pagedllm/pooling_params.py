"""PoolingParams: an embedding request's settings (vLLM's fields).

An embedding request is a prefill with no decode: its prompt runs through the model as any
prompt does (chunked, batched with generation requests, its full blocks shared through the prefix
cache), and where a generation request would sample its first token, the final hidden state of the
prompt's last token (after the final norm: last-token pooling, as Qwen3-Embedding and vLLM's
decoder embedding models pool) is the request's output, and the request ends.
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

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or not 1 <= self.dimensions <= limits.INT32_MAX
        ):
            raise ValueError(f"dimensions: must be an integer >= 1, got {self.dimensions!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {self.normalize!r}")

    def pool(self, last_hidden: torch.Tensor) -> list[float]:
        """last_hidden: the prompt's last token's final (normed) hidden state, [hidden_size]."""
        vector = last_hidden.float()[: self.dimensions]
        if self.normalize:
            vector = F.normalize(vector, dim=-1)
        return vector.tolist()
