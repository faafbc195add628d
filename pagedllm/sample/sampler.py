"""Sampler: logits of the sampled rows -> one token per request, batched.

Order, as in vLLM: raw logprobs (if asked) -> penalties -> logit bias -> min_tokens masking -> greedy
rows take the argmax; the others are divided by their temperature, cut by top-k, top-p
and min-p, and drawn with the exponential-race trick (argmax of p / E, E ~ Exp(1)),
which equals sampling from p. A request with a seed draws its E from its own generator,
so its tokens do not depend on what else is in the batch.
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
        raw_logprobs = _raw_logprobs(logits, metadata)
        logits = _adjusted(logits, metadata)
        tokens = argmax(logits) if metadata.all_greedy else self._sample(logits, metadata)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, [None] * len(token_list)
        return token_list, gather_logprobs(raw_logprobs, tokens, metadata.num_logprobs)

    def verify(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Speculative decoding's check, per request: logits has len(d) + 1 rows for each draft d
        (the positions of its last token and of each draft token), metadata one row per logits
        row. Returns each request's tokens: the accepted draft tokens, then one more; and each
        token's logprobs, from its own position's row, as plain sampling reports them.

        Greedy: a draft token is accepted while it is the argmax, and the first that is not is
        replaced by the argmax, so the tokens are those plain decoding gives. Otherwise
        rejection sampling with a deterministic proposer (q one-hot): draft token d at a position
        with target distribution p is accepted with probability p(d); on a rejection the token is
        drawn from p with d removed, renormalized; after all are accepted, the next is drawn from
        the last position's p. Each token is then distributed as plain sampling's. A request with
        a seed draws instead as plain sampling does, position by position from its own generator
        (the exponential race), and keeps a draft token while that draw is it: the same tokens
        as without speculation, draw for draw, and the same acceptance (d is drawn with p(d))."""
        raw_logprobs = _raw_logprobs(logits, metadata)
        logits = _adjusted(logits, metadata)
        greedy_tokens = argmax(logits).tolist()
        probs = None if metadata.all_greedy else self._probs(logits, metadata)
        is_greedy = metadata.is_greedy.tolist()
        results, first = [], 0
        for draft in drafts:
            tokens: list[int] = []
            for i in range(len(draft) + 1):
                row = first + i
                if is_greedy[row]:
                    tokens.append(greedy_tokens[row])
                    accepted = i < len(draft) and greedy_tokens[row] == draft[i]
                elif (generator := metadata.generators.get(row)) is not None:
                    assert probs is not None
                    tokens.append(self._draw(probs[row], generator))
                    accepted = i < len(draft) and tokens[-1] == draft[i]
                else:
                    assert probs is not None
                    p = probs[row]
                    accepted = i < len(draft) and float(
                        torch.rand((), generator=self.generator, device=p.device)
                    ) < float(p[draft[i]])
                    if accepted:
                        tokens.append(draft[i])
                    else:
                        if i < len(draft):  # the residual: p without the rejected token
                            p = p.clone()
                            p[draft[i]] = 0.0
                        tokens.append(self._draw(p))
                if not accepted:
                    break
            results.append(tokens)
            first += len(draft) + 1
        if raw_logprobs is None:
            return results, [[None] * len(tokens) for tokens in results]
        return results, self._logprobs_of_runs(raw_logprobs, metadata, drafts, results)

    @staticmethod
    def _logprobs_of_runs(
        raw_logprobs: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]], runs: list[list[int]]
    ) -> list[list[TokenLogprobs | None]]:
        """Each run's tokens' logprobs: token j of a request's run at its row first + j."""
        rows: list[int] = []
        firsts: list[int] = []
        first = 0
        for draft, tokens in zip(drafts, runs, strict=True):
            firsts.append(len(rows))
            rows += range(first, first + len(tokens))
            first += len(draft) + 1
        flat = [token for tokens in runs for token in tokens]
        entries = gather_logprobs(
            raw_logprobs[rows],
            torch.tensor(flat, device=raw_logprobs.device),
            [metadata.num_logprobs[row] for row in rows],
        )
        return [entries[at : at + len(tokens)] for at, tokens in zip(firsts, runs, strict=True)]

    def _draw(self, p: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """One token from the (unnormalized) probabilities p, by the exponential race: as
        _sample draws a row, from `generator` (a seeded request's) or the sampler's own."""
        noise = torch.empty_like(p).exponential_(generator=self.generator if generator is None else generator)
        return int((p / noise).argmax())

    def _probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        scaled = logits / metadata.temperature.to(logits.device)[:, None]
        return torch.softmax(_apply_top_k_top_p_min_p(scaled, metadata), dim=-1)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        probs = self._probs(logits, metadata)

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


def _raw_logprobs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """Log-probabilities before any adjustment, where a row asks for logprobs (as vLLM reports)."""
    if all(k is None for k in metadata.num_logprobs):
        return None
    return torch.log_softmax(logits, dim=-1)


def _adjusted(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
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
