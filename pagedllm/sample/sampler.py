"""Sampler: logits of the sampled rows -> one token per request, batched.

Order, as in vLLM: raw logprobs (if asked) -> penalties -> logit bias -> min_tokens masking -> greedy
rows take the argmax; the others are divided by their temperature, cut by top-k, top-p
and min-p, and drawn with the exponential-race trick (argmax of p / E, E ~ Exp(1)),
which equals sampling from p. A request with a seed draws its E from its own generator,
so its tokens do not depend on what else is in the batch. Draft tokens (speculative decoding)
are checked in rejection.py, through the same adjustments and generator.
"""

from __future__ import annotations

import torch

from pagedllm.core.outputs import TokenLogprobs
from pagedllm.kernels.cpu_ops import argmax
from pagedllm.sample.metadata import Penalties, SamplingMetadata


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Draws of the requests without a seed of their own."""

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_reqs, vocab] float32. Returns the tokens and, per request, its logprobs."""
        raw = raw_logprobs(logits, metadata)
        logits = adjusted_logits(logits, metadata)
        tokens = argmax(logits) if metadata.all_greedy else self._sample(logits, metadata)
        token_list = tokens.tolist()
        if raw is None:
            return token_list, [None] * len(token_list)
        return token_list, gather_logprobs(raw, tokens, metadata.num_logprobs)

    def probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distributions a row draws from (temperature, then top-k, top-p and min-p);
        shared with the check of draft tokens (rejection.py)."""
        scaled = logits / metadata.temperature.to(logits.device)[:, None]
        return torch.softmax(_apply_top_k_top_p_min_p(scaled, metadata), dim=-1)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        probs = self.probs(logits, metadata)

        noise = torch.empty_like(probs)
        unseeded = [row for row in range(probs.shape[0]) if row not in metadata.generators]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for row, generator in metadata.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(metadata.is_greedy.to(logits.device), argmax(logits), sampled)


def raw_logprobs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """Log-probabilities before any adjustment, where a row asks for logprobs (as vLLM reports)."""
    if all(k is None for k in metadata.num_logprobs):
        return None
    return torch.log_softmax(logits, dim=-1)


def adjusted_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalties, logit bias and min_tokens' banned tokens applied (a copy where any is)."""
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    if metadata.logit_bias is not None:
        logits = logits.clone()
        rows, cols, biases = metadata.logit_bias
        logits[rows, cols] += torch.tensor(biases, device=logits.device, dtype=logits.dtype)
    if metadata.banned is not None:
        logits = logits.clone()
        logits[metadata.banned] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """vLLM's semantics: repetition divides positive / multiplies negative logits of tokens
    seen in prompt or output; frequency subtracts per output occurrence; presence once."""
    device = logits.device
    rows = penalties.rows.to(device)
    penalized_rows = logits[rows]
    token_ids = penalties.token_ids.to(device)
    output_counts = torch.zeros_like(penalized_rows).scatter_add_(
        1, token_ids, penalties.is_output.to(device, logits.dtype)
    )
    prompt_counts = torch.zeros_like(penalized_rows).scatter_add_(
        1, token_ids, penalties.is_prompt.to(device, logits.dtype)
    )
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = penalties.repetition.to(device)
    penalized = torch.where(penalized_rows > 0, penalized_rows / rep, penalized_rows * rep)
    penalized_rows = torch.where(seen, penalized, penalized_rows)
    penalized_rows = (
        penalized_rows
        - penalties.frequency.to(device) * output_counts
        - penalties.presence.to(device) * (output_counts > 0).to(logits.dtype)
    )
    logits = logits.clone()
    logits[rows] = penalized_rows
    return logits


def _apply_top_k_top_p_min_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    if metadata.top_k is not None and metadata.top_p is not None:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= metadata.top_k.to(device)[:, None]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # keep a token while the mass before it is below top_p (the top token always stays)
        drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= metadata.top_p.to(device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if metadata.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * metadata.min_p.to(device)[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    """Per row: the given token's logprob and rank, then the row's top-k (k from num_top;
    None skips the row). raw_logprobs: [num_rows, vocab], token_ids: [num_rows]."""
    chosen = raw_logprobs.gather(1, token_ids[:, None])  # [num_rows, 1]
    ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
    max_k = max((k for k in num_top if k), default=0)
    top_lp, top_ids = raw_logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    chosen_list, token_list = chosen[:, 0].tolist(), token_ids.tolist()
    results: list[TokenLogprobs | None] = []
    for i, k in enumerate(num_top):
        if k is None:
            results.append(None)
            continue
        # k > 0 means max_k > 0, so topk ran and top_ids, top_lp are tensors
        ids = [token_list[i]] + (top_ids[i, :k].tolist() if k else [])  # type: ignore[index]
        lps = [chosen_list[i]] + (top_lp[i, :k].tolist() if k else [])  # type: ignore[index]
        results.append(TokenLogprobs(ids, lps, [ranks[i], *range(1, k + 1)]))
    return results
