"""pagedllm: LLM inference and serving around a paged KV cache.

The public classes load on first use (PEP 562): `import pagedllm` and every `pagedllm.x` import
go through this file, and the command line's `--version` and `--help` must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedllm.version import __version__

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora_request import LoRARequest
    from pagedllm.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringRequestOutput,
    )
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams

_PUBLIC = {
    "LLM": "pagedllm.entrypoints.llm",
    "CompletionOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "Logprob": "pagedllm.outputs",
    "LoRARequest": "pagedllm.lora_request",
    "PoolingParams": "pagedllm.pooling_params",
    "RequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
    "SamplingParams": "pagedllm.sampling_params",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
