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


@dataclass
class GrammarBitmask:
    req_ids: list[str]
    """The constrained requests that sample this step, one bitmask row each."""
    bitmask: torch.Tensor
    """[len(req_ids), ceil(vocab / 32)] int32, on the CPU."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose matcher raised: they fail alone."""


def fill_bitmask(grammars: Sequence[tuple[str, RequestGrammar]]) -> GrammarBitmask | None:
    """Bitmask rows for (request id, grammar) pairs; None when there are none."""
    if not grammars:
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(grammars), grammars[0][1].vocab_size)
    failed = {}
    for row, (req_id, grammar) in enumerate(grammars):
        try:
            grammar.fill_bitmask(bitmask, row)
        except Exception as error:  # one matcher's fault is its request's alone
            failed[req_id] = f"structured output: {type(error).__name__}: {error}"
            continue
        if not bitmask[row].any():  # a dead end: no token of this vocabulary can continue the output
            failed[req_id] = (
                f"{INVALID_REQUEST}structured_outputs: the output reached a point of the grammar that "
                "no token of this model's vocabulary can continue"
            )
    return GrammarBitmask([req_id for req_id, _ in grammars], bitmask, failed)


def apply_bitmask(logits: torch.Tensor, grammar: GrammarBitmask, row_of: dict[str, int]) -> None:
    """Forbidden tokens of the constrained rows -> -inf, in place. logits: [rows, vocab] float32."""
    import torch
    import xgrammar

    rows = [row_of[req_id] for req_id in grammar.req_ids]
    if rows != list(range(logits.shape[0])):  # free rows in the batch too: all bits set
        full = torch.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = grammar.bitmask
        bitmask = full
    else:
        bitmask = grammar.bitmask
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
