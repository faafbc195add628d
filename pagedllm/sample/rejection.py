"""Speculative decoding's check of draft tokens (vLLM's rejection_sampler.py): the target model's
logits at a request's last known token and at each of its draft tokens decide which of those draft
tokens it keeps, and the one token that follows them.

Logits layout, per request with draft d (requests one after another):

    row:    first      first + 1   ...   first + len(d)
    scores: d[0]       d[1]        ...   (the token after a full match)

Greedy rows keep a draft token while it is the argmax, and the first that is not is replaced by
the argmax: the tokens plain decoding gives. Other rows use rejection sampling with a deterministic
proposer (q one-hot): draft token d at a position with target distribution p is accepted with
probability p(d); on a rejection the token is drawn from p with d removed, renormalized; after all
are accepted, the next is drawn from the last position's p. Each token is then distributed as plain
sampling's. A request with a seed draws instead as plain sampling does, position by position from
its own generator, each row cut alone, and keeps a draft token while that draw is it: the same
tokens as without speculation, draw for draw, and the same acceptance (d is drawn with p(d)).

It shares the Sampler's adjustments (penalties, bias, min_tokens bans, temperature and top-k/p/min-p)
and its generator, so an unseeded request's draws come from the one stream plain sampling uses.
"""

from __future__ import annotations

import torch

from pagedllm.core.outputs import TokenLogprobs
from pagedllm.kernels.cpu_ops import argmax
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import (
    Sampler,
    adjusted_logits,
    candidates,
    exponential,
    gather_logprobs,
    raw_logprobs,
    whole_vocabulary_probs,
)


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Check each request's draft.

        Args:
            logits: [sum(len(d) + 1 for d in drafts), vocab] float32, laid out as drawn above.
            metadata: one row per logits row (a request's settings repeated over its rows).
            drafts: each request's draft tokens.

        Returns:
            Each request's tokens (the accepted draft tokens, then one more) and each token's
            logprobs, from its own position's row, as plain sampling reports them.
        """
        raw = raw_logprobs(logits, metadata)
        logits = adjusted_logits(logits, metadata)
        greedy_tokens = argmax(logits).tolist()
        groups = [] if metadata.all_greedy else candidates(logits, metadata)
        # a seeded row is cut alone, and drawn only where the run reaches it (its generator's order)
        seeded = {group.rows[0]: group for group in groups if group.rows[0] in metadata.generators}
        unseeded = [group for group in groups if group.rows[0] not in seeded]
        probs = whole_vocabulary_probs(unseeded, logits) if unseeded else None
        is_greedy = metadata.is_greedy.tolist()
        results, first = [], 0
        for draft in drafts:
            tokens: list[int] = []
            for i in range(len(draft) + 1):
                row = first + i
                if is_greedy[row]:
                    tokens.append(greedy_tokens[row])
                    accepted = i < len(draft) and greedy_tokens[row] == draft[i]
                elif row in seeded:
                    tokens.append(int(seeded[row].draw(metadata.generators[row])[0]))
                    accepted = i < len(draft) and tokens[-1] == draft[i]
                else:
                    assert probs is not None
                    p = probs[row]
                    accepted = i < len(draft) and float(
                        torch.rand((), generator=self.sampler.generator, device=p.device)
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
        if raw is None:
            return results, [[None] * len(tokens) for tokens in results]
        return results, _logprobs_of_runs(raw, metadata, drafts, results)

    def _draw(self, p: torch.Tensor) -> int:
        """One token from the (unnormalized) probabilities p, by the exponential race, from the
        sampler's own generator."""
        return int((p / exponential(p.shape, self.sampler.generator, p.device)).argmax())


def _logprobs_of_runs(
    raw: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]], runs: list[list[int]]
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
        raw[rows],
        torch.tensor(flat, device=raw.device),
        [metadata.num_logprobs[row] for row in rows],
    )
    return [entries[at : at + len(tokens)] for at, tokens in zip(firsts, runs, strict=True)]
