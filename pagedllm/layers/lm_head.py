"""The LM head: final hidden states -> float32 logits, split over the ranks by vocabulary rows
where they divide the vocabulary (each rank computes its share, rank 0 gathers them and
samples), else whole on every rank and computed by rank 0 alone."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.linear import Linear, Loaded, rows_of
from pagedllm.layers.linear_dispatch import LinearDispatch
from pagedllm.layers.quantization import BlockQuantized


class ParallelLMHead(Linear):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None) -> None:
        vocab_parallel = tp is not None and vocab_size % tp.world_size == 0
        rows = vocab_size // tp.world_size if tp is not None and vocab_parallel else vocab_size
        super().__init__(hidden_size, rows)
        self.tp = tp
        self.vocab_parallel = vocab_parallel
        self.is_computed_here = tp is None or tp.is_driver or vocab_parallel
        self.is_tied = False
        self.packed_copy_bytes = 0
        """A tied head's own packed copy: the embedding lookup keeps the plain (or compact) table."""

    def tie(self, embedding: torch.Tensor) -> None:
        """Share the embedding's weight (this rank's rows of it, when split by vocabulary)."""
        self.is_tied = True
        if not self.vocab_parallel:
            self.weight = embedding
            return
        assert self.tp is not None
        rows = self.out_features
        self.weight = nn.Parameter(embedding.narrow(0, self.tp.rank * rows, rows))

    def tie_quantized(self, table: BlockQuantized) -> None:
        """Compute from the embedding's quantized table (this rank's rows of it when split)."""
        if self.vocab_parallel:
            assert self.tp is not None
            table = table.rows(self.tp.rank * self.out_features, self.out_features)
        self.set_quantized(table)

    def choose_impl(
        self, device: torch.device, dtype: torch.dtype, dispatch: LinearDispatch | None = None
    ) -> None:
        if not self.is_computed_here:
            return  # rank 0 alone computes logits: no packed copy here
        before = self.weight
        super().choose_impl(device, dtype, dispatch)
        if self.is_tied and self.weight is not before:
            self.packed_copy_bytes = self.weight.numel() * self.weight.element_size()

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        super().weight_loader(param, self._rows(loaded) if self.vocab_parallel else loaded, shard_id)

    def _rows(self, loaded: Loaded) -> Loaded:
        """This rank's vocabulary rows."""
        assert self.tp is not None
        return rows_of(loaded, self.tp.rank * self.out_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        """x: [num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]; split by
        vocabulary, every rank calls it and rank 0 alone gets them (others: None)."""
        logits = super().forward(x).float()
        if not self.vocab_parallel:
            return logits
        assert self.tp is not None
        return self.tp.gather_columns(logits)
