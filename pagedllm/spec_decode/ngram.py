"""n-gram prompt lookup (vLLM's `ngram` method): the context's last n tokens, for the longest n from
prompt_lookup_max down to prompt_lookup_min that occurs earlier in the context, and the tokens
that followed its latest earlier occurrence are the proposal. No model, no state: where an answer
quotes its prompt (a summary, a code edit, JSON echoing its input) the next tokens are often there.

It runs for every decoding request after every step, so it costs one pass over the context (the
places where the last token occurred before) and then only those places, however long the match.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, req_id: str, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens to follow `token_ids` (a request's prompt and output so far)."""
        length = len(token_ids)
        if max_tokens <= 0 or length < 2:
            return []
        # ends: where an earlier occurrence of the context's last n tokens ends (before the last token)
        ends = np.flatnonzero(token_ids[: length - 1] == token_ids[length - 1])
        matched = np.ones(len(ends), dtype=np.int64)  # how many tokens match, backwards from each end
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, min(self.max_n, length - 1)):
            if not alive.any():
                break
            alive &= ends >= back
            alive[alive] = token_ids[ends[alive] - back] == token_ids[length - 1 - back]
            matched += alive
        if not len(ends) or matched.max() < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched == matched.max())[-1]]) + 1
        return token_ids[start : start + max_tokens].tolist()

    def finish(self, req_id: str) -> None:
        """Nothing is kept per request."""
