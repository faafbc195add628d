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
from pagedllm.sample.metadata import SamplingMetadata


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._request_generators.pop(req_id, None)

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_reqs, vocab] float32. Returns the tokens and, per request, its logprobs."""
        params = metadata.params
        wants_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None

        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, metadata)
        if any(p.logit_bias for p in params):
            logits = _apply_logit_bias(logits, params)
        logits = _mask_until_min_tokens(logits, metadata)

        greedy = all(p.is_greedy for p in params)
        tokens = argmax(logits) if greedy else self._sample(logits, metadata)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, [None] * len(params)
        return token_list, gather_logprobs(raw_logprobs, tokens, [p.logprobs for p in params])

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        params = metadata.params
        is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        temperature = torch.tensor(
            [p.temperature if not p.is_greedy else 1.0 for p in params],
            device=logits.device,
            dtype=logits.dtype,
        )
        scaled = logits / temperature[:, None]
        scaled = _apply_top_k_top_p_min_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)

        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, p in enumerate(params):
            if p.seed is not None:
                noise[i].exponential_(generator=self._generator_for(metadata.req_ids[i], p.seed))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, argmax(logits), sampled)

    def _generator_for(self, req_id: str, seed: int) -> torch.Generator:
        generator = self._request_generators.get(req_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._request_generators[req_id] = generator
        return generator


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM's semantics: repetition divides positive / multiplies negative logits of tokens
    seen in prompt or output; frequency subtracts per output occurrence; presence once."""
    num_reqs, vocab = logits.shape
    device = logits.device
    output_counts = torch.zeros(num_reqs, vocab, device=device)
    seen = torch.zeros(num_reqs, vocab, dtype=torch.bool, device=device)
    params = metadata.params
    for i, p in enumerate(params):
        if not p.has_penalties:
            continue
        out_ids = torch.tensor(metadata.output_token_ids[i], dtype=torch.long, device=device)
        output_counts[i].index_add_(0, out_ids, torch.ones(len(out_ids), device=device))
        seen[i, torch.tensor(metadata.prompt_token_ids[i], dtype=torch.long, device=device)] = True
    seen |= output_counts > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * output_counts - pres * (output_counts > 0).to(logits.dtype)


def _apply_logit_bias(logits: torch.Tensor, params: list) -> torch.Tensor:
    rows, cols, biases = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            biases.append(bias)
    logits = logits.clone()
    logits[rows, cols] += torch.tensor(biases, device=logits.device, dtype=logits.dtype)
    return logits


def _mask_until_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    rows, cols = [], []
    for i, (params, output_ids) in enumerate(zip(metadata.params, metadata.output_token_ids, strict=True)):
        if len(output_ids) < params.min_tokens:
            banned = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned |= metadata.eos_token_ids[i]
            rows += [i] * len(banned)
            cols += sorted(banned)
    if rows:
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
    return logits


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    vocab = logits.shape[1]
    top_k = [min(p.top_k or vocab, vocab) for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=logits.device)[:, None]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # keep a token while the mass before it is below top_p (the top token always stays)
        drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= torch.tensor(top_p, device=logits.device)[
            :, None
        ]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = (
            probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=logits.device)[:, None]
        )
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
