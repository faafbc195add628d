"""n-gram prompt lookup (vLLM's `ngram` method): the context's last n tokens, for the longest n from
prompt_lookup_max down to prompt_lookup_min that occurs earlier in the context, and the tokens
that followed its latest earlier occurrence are the proposal. No model, no state: where an answer
quotes its prompt (a summary, a code edit, JSON echoing its input) the next tokens are often there.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, req_id: str, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens to follow `token_ids` (a request's prompt and output so far)."""
        length = len(token_ids)
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n :]
            # windows that end before the last token, so something follows each
            windows = sliding_window_view(token_ids[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start : start + max_tokens].tolist()
        return []

    def finish(self, req_id: str) -> None:
        """Nothing is kept per request."""
