"""Sampler: logits of the sampled rows -> one token per request, batched.

Order, as in vLLM: raw logprobs (if asked) -> penalties -> logit bias -> min_tokens masking -> greedy
rows take the argmax; the others are divided by their temperature and cut as transformers' warpers
cut, one after another: top-k, then top-p on what top-k left (renormalized), then min-p. What is
left is drawn with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which equals sampling
from p. A request with a seed has its row cut and drawn alone, from its own generator, so its
tokens do not depend on what else is in the batch. Draft tokens (speculative decoding) are
checked in rejection.py, through the same adjustments and draws.

A cut row is worked on its candidates only: its top-k tokens, or for top-p without top-k its most
likely ones, as many as hold its top_p of the mass (TOP_P_WIDTHS; the whole row sorted where
they do not, or where the candidates would be a quarter of the vocabulary or more). The noise of
the race is drawn for the candidates only, as -log(U).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.outputs import TokenLogprobs
from pagedllm.kernels.cpu_ops import argmax
from pagedllm.sample.metadata import Penalties, SamplingMetadata

TOP_P_WIDTHS = (256, 4096)
"""How many of its most likely tokens a top-p row without a top-k is cut among: 256, then 4,096
where those hold less than its top_p of the mass, then all of them, sorted (a width the row's
mass so far shows too few is skipped)."""


@dataclass(frozen=True)
class Candidates:
    """Rows of a step cut alike: each row's scaled logits at its candidates (-inf where cut), and
    the candidates' token ids (None: the whole vocabulary, in order)."""

    rows: list[int]
    values: torch.Tensor
    ids: torch.Tensor | None

    def probs(self) -> torch.Tensor:
        return torch.softmax(self.values, dim=-1)

    def draw(self, generator: torch.Generator) -> torch.Tensor:
        """One token per row by the exponential race, its noise from `generator`."""
        probs = self.probs()
        picked = (probs / exponential(probs.shape, generator, probs.device)).argmax(dim=-1)
        return picked if self.ids is None else self.ids.gather(1, picked[:, None])[:, 0]


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

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        tokens = argmax(logits)  # the greedy rows' tokens
        for group in candidates(logits, metadata):
            rows = torch.tensor(group.rows, device=logits.device)
            generator = metadata.generators.get(group.rows[0], self.generator)
            tokens[rows] = group.draw(generator)
        return tokens


def whole_vocabulary_probs(groups: list[Candidates], logits: torch.Tensor) -> torch.Tensor:
    """The groups' distributions spread over `logits`' shape: zeros at the rows no group holds
    and at the tokens a group cut."""
    probs = torch.zeros_like(logits)
    for group in groups:
        rows = torch.tensor(group.rows, device=logits.device)
        if group.ids is None:
            probs[rows] = group.probs()
        else:
            probs[rows] = torch.zeros_like(logits[rows]).scatter_(1, group.ids, group.probs())
    return probs


def exponential(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) draws, as -log(U): torch's exponential_ draws one element at a time, ~5x slower on CPU.
    U = 0 (torch.rand draws it about once in 2^24) is taken as the least positive float: an
    infinite draw would make a row's only likely token's p / E zero, and argmax would pick token 0."""
    uniform = torch.rand(shape, generator=generator, device=device)
    return uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()


def candidates(logits: torch.Tensor, metadata: SamplingMetadata) -> list[Candidates]:
    """The sampled rows, cut: each seeded row alone, then the other rows that cut by top-k or
    top-p together, then those that do not (the whole vocabulary)."""
    greedy = metadata.is_greedy.tolist()
    cuts = [False] * len(greedy)
    if metadata.top_k is not None and metadata.top_p is not None:
        cuts = ((metadata.top_k < logits.shape[1]) | (metadata.top_p < 1)).tolist()
    groups: list[list[int]] = [[], [], []]  # seeded, cutting, whole
    for row, is_greedy in enumerate(greedy):
        if not is_greedy:
            groups[0 if row in metadata.generators else 1 if cuts[row] else 2].append(row)
    alone = [[row] for row in groups[0]]
    return [
        cut
        for rows in alone + [rows for rows in groups[1:] if rows]
        for cut in _cut(logits if len(rows) == logits.shape[0] else logits[rows], metadata, rows)
    ]


def _cut(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> list[Candidates]:
    """Rows' logits (in `rows`' order) scaled by their temperature and cut: top-k, top-p, min-p;
    in parts where rows needed different numbers of candidates."""
    device = logits.device
    index = torch.tensor(rows)
    scaled = logits / metadata.temperature[index].to(device)[:, None]
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = [(index, scaled, None)]
    if metadata.top_k is not None and metadata.top_p is not None:
        top_k, top_p = metadata.top_k[index].to(device), metadata.top_p[index].to(device)
        if bool((top_k < scaled.shape[1]).any() | (top_p < 1).any()):
            parts = [(index[at.cpu()], values, ids) for at, values, ids in _top_k_top_p(scaled, top_k, top_p)]
    cut = []
    for part_index, values, ids in parts:
        if metadata.min_p is not None:
            probs = values.softmax(dim=-1)
            min_p = metadata.min_p[part_index].to(device)[:, None]
            values = values.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, float("-inf"))
        cut.append(Candidates(part_index.tolist(), values, ids))
    return cut


def _top_k_top_p(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows, candidates' values, their ids) parts: the rows' most likely tokens, top-k cut, then
    top-p cut on the distribution top-k left (a token stays while the mass before it is below
    top_p; the most likely always stays). A top-k row's candidates are its top k; a top-p row
    without one goes on to more (TOP_P_WIDTHS, then the whole row) until they hold its top_p."""
    vocab = scaled.shape[1]
    cuts_k = top_k < vocab
    pending = torch.arange(scaled.shape[0], device=scaled.device)
    width = int(torch.where(cuts_k, top_k, TOP_P_WIDTHS[0]).max())
    parts = []
    while True:
        at_k, at_p, rows = top_k[pending], top_p[pending], scaled[pending]
        if 4 * width >= vocab:  # a large top-k: the sort is the cheaper way to that many
            width = vocab
        if width < vocab:
            values, ids = rows.topk(width, dim=-1)
        else:
            values, ids = rows.sort(dim=-1, descending=True)
        ranks = torch.arange(values.shape[1], device=scaled.device)
        values = values.masked_fill(ranks >= at_k[:, None], float("-inf"))
        # a top-k row is normalized over its k candidates, any other over its whole row
        log_total = torch.where(at_k < vocab, values.logsumexp(dim=-1), rows.logsumexp(dim=-1))
        probs = (values - log_total[:, None]).exp()
        before = probs.cumsum(dim=-1) - probs
        # a top_p of 1 cuts nothing (the float sum of the mass before a tail token can round to 1)
        values = values.masked_fill((before >= at_p[:, None]) & (at_p[:, None] < 1), float("-inf"))
        held = before[:, -1] + probs[:, -1]
        done = (at_k < vocab) | (held >= at_p) | (width >= vocab)
        if bool(done.any()):
            parts.append((pending[done], values[done], ids[done]))
        if bool(done.all()):
            return parts
        # the tokens past these are each at most as likely as the last: a row needs at least
        # (top_p - held) / p_last more, so a width no row can be done at is skipped
        needed = width + float(((at_p - held) / probs[:, -1])[~done].min())
        pending = pending[~done]
        width = next((w for w in TOP_P_WIDTHS if needed <= w), vocab)


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
