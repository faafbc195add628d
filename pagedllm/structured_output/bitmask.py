"""The per-step token bitmask of the constrained rows: filled by the scheduler's side, applied to
the logits by the runner (32 tokens per int32 word; a clear bit forbids its token).

The scheduler imports this file, and core/ imports no torch: torch comes in with xgrammar, when a
step first has a constrained row (the bitmask is the torch tensor xgrammar allocates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.outputs import INVALID_REQUEST

if TYPE_CHECKING:
    import torch

    from pagedllm.structured_output.backend import RequestGrammar


DEAD_END = (
    f"{INVALID_REQUEST}structured_outputs: the output reached a point of the grammar that no token of "
    "this model's vocabulary can continue"
)


@dataclass
class GrammarBitmask:
    rows: list[tuple[str, int]]
    """Per bitmask row, its request and position in the step: 0 for the request's next token,
    i for the token after its i-th draft token (speculative decoding)."""
    bitmask: torch.Tensor
    """[len(rows), ceil(vocab / 32)] int32, on the CPU."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose matcher raised or is at a dead end: they fail alone."""
    dead_ends: dict[str, int] = field(default_factory=dict)
    """Request -> the first position after a draft token where no token can follow: the token
    sampled there cannot be kept, and the request fails with DEAD_END after the ones before."""


def fill_bitmask(grammars: Sequence[tuple[str, RequestGrammar, list[int]]]) -> GrammarBitmask | None:
    """Bitmask rows for (request id, grammar, draft tokens checked this step) triples: one row per
    position the request samples at; None when there are none.

    A dead end (no token of the vocabulary may come next) at a request's next token fails the
    request, as it would without speculation. One after a draft token has all bits set (the
    sampler needs some token there) and is listed in dead_ends: the scheduler keeps the tokens
    before it and fails the request there, as plain decoding would one step later."""
    if not grammars:
        return None
    import xgrammar

    rows = [(req_id, i) for req_id, _, draft in grammars for i in range(len(draft) + 1)]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), grammars[0][1].vocab_size)
    failed: dict[str, str] = {}
    dead_ends: dict[str, int] = {}
    first = 0
    for req_id, grammar, draft in grammars:
        try:
            grammar.fill_bitmasks(bitmask, first, draft)
        except Exception as error:  # one matcher's fault is its request's alone
            failed[req_id] = f"structured output: {type(error).__name__}: {error}"
        else:
            if not bitmask[first].any():
                failed[req_id] = DEAD_END
            for row in range(first + 1, first + len(draft) + 1):
                if not bitmask[row].any():
                    bitmask[row] = -1
                    dead_ends.setdefault(req_id, row - first)
        first += len(draft) + 1
    return GrammarBitmask(rows, bitmask, failed, dead_ends)


def apply_bitmask(logits: torch.Tensor, grammar: GrammarBitmask, first_row_of: dict[str, int]) -> None:
    """Forbidden tokens of the constrained rows -> -inf, in place. logits: [rows, vocab] float32;
    first_row_of: each sampling request's first row there (its next token's)."""
    import torch
    import xgrammar

    rows = [first_row_of[req_id] + position for req_id, position in grammar.rows]
    if rows != list(range(logits.shape[0])):  # free rows in the batch too: all bits set
        full = torch.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = grammar.bitmask
        bitmask = full
    else:
        bitmask = grammar.bitmask
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
