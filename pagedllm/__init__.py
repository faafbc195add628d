"""pagedllm: LLM inference and serving around a paged KV cache."""

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
