"""What the sampler reads of a step: one column per field, one entry per sampled row, in the order
of the logits' rows (vLLM's SamplingMetadata).

The runner builds it from its request table each step, so the sampler never sees the runner's
types. The token lists are the runner's own, not copies: the sampler only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingMetadata:
    req_ids: list[str]
    """Keys of the per-request generators (seeded requests)."""
    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    """Read by the repetition penalty."""
    output_token_ids: list[list[int]]
    """Tokens sampled so far: penalties and min_tokens read them."""
    eos_token_ids: list[frozenset[int]]
    """Banned with the stop tokens until min_tokens (unless ignore_eos)."""
