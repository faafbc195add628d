"""The proposer a --speculative-config names: draft tokens from a request's own context (ngram)
or from a suffix tree of it and of earlier outputs (suffix). The model runner asks it after each
step for the requests that sampled, and tells it which requests ended."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import SuffixProposer
from pagedllm.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, req_id: str, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow token_ids, the request's prompt and output."""
        ...

    def finish(self, req_id: str) -> None:
        """The request ended: drop what is kept for it alone."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.method == "suffix"  # SpeculativeConfig checked it
    return SuffixProposer(
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
    )
