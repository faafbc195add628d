"""What the sampler reads of a step: one entry per sampled row, in the order of the logits' rows
(vLLM's SamplingMetadata). The runner's input batch gathers it from its row arrays each step, so
the sampler never sees the runner's types; a column that no row of the step uses is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """The rows with a repetition, frequency or presence penalty, and the tokens they read."""

    rows: torch.Tensor
    """[m] int64: which rows of the step."""
    token_ids: torch.Tensor
    """[m, length] int64: each row's prompt, then its output, then padding."""
    is_prompt: torch.Tensor
    """[m, length] bool: the position holds a prompt token."""
    is_output: torch.Tensor
    """[m, length] bool: the position holds an output token."""
    repetition: torch.Tensor
    """[m, 1] float32, and so the next two."""
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass(frozen=True)
class SamplingMetadata:
    all_greedy: bool
    is_greedy: torch.Tensor
    """[n] bool."""
    temperature: torch.Tensor
    """[n] float32, 1.0 on greedy rows."""
    top_k: torch.Tensor | None
    """[n] int64 (the vocabulary size where a row does not cut); None with top_p: no row cuts."""
    top_p: torch.Tensor | None
    """[n] float32 (1.0 where a row does not cut)."""
    min_p: torch.Tensor | None
    """[n] float32; None: no row cuts by min_p."""
    generators: dict[int, torch.Generator]
    """Row -> its request's own generator (seeded requests: their draws do not depend on the batch)."""
    penalties: Penalties | None
    logit_bias: tuple[list[int], list[int], list[float]] | None
    """(rows, token ids, biases)."""
    banned: tuple[list[int], list[int]] | None
    """(rows, token ids) set to -inf: stop and end-of-sequence tokens before min_tokens."""
    num_logprobs: list[int | None]
    """Per row: the top-k logprobs asked for (0: the sampled token's only); None: none."""
