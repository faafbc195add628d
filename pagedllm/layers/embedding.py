"""The token embedding: float rows, or rows kept in their quantized blocks and dequantized as looked up.

A step looks up a few hundred rows at most, so a quantized table costs a gather and a multiply-add
per step and saves its float copy: for a 128k vocabulary that is the size of a small model. A GGUF's
table is held as the file stores it (its rows read out as looked up); others as codes, 4-bit ones
two to a byte.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.direct_call import DirectCall
from pagedllm.layers.linear import Loaded, copy_weight
from pagedllm.layers.quantization import BLOCK, BlockQuantized


class VocabEmbedding(DirectCall, nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.hidden_size = hidden_size
        self.quantized: BlockQuantized | None = None
        """The table as loaded, when the checkpoint kept it quantized (a tied head packs it too)."""
        self.weight_format = ""
        self.decode: Callable[[torch.Tensor], BlockQuantized] | None = None
        """How the file's rows (self.raw) read out, where the table is held as the file stores it."""
        self.encoding = ""
        """The file's format, where cpu_ops.gguf_rows reads its rows out instead of decode."""
        self._dtype = torch.float32

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None) -> None:
        if isinstance(loaded, BlockQuantized):
            if loaded.shape != param.shape:
                raise ValueError(f"shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
            self.quantized = loaded
            return
        copy_weight(param.data, loaded)

    def choose_impl(self, device: torch.device, dtype: torch.dtype) -> None:
        """A quantized table stays compact (its rows dequantized as looked up)."""
        if self.quantized is not None:
            self.keep_quantized(dtype)

    def keep_quantized(self, dtype: torch.dtype) -> None:
        """Hold the quantized table compactly in place of the float weight, rows out in `dtype`:
        the file's own rows where they are still encoded (read out as looked up), else codes and
        float32 scales and mins."""
        assert self.quantized is not None
        table, device = self.quantized, self.weight.device
        encoded = table.still_encoded
        if encoded is not None:  # a copy: the mapped file is let go once every layer has packed
            self.raw = nn.Parameter(encoded.raw.clone().to(device), requires_grad=False)
            self.decode = encoded.decode
            # on CPU one C++ pass reads the looked-up rows out (a dozen tensor ops otherwise)
            if cpu_ops.serves_layer_ops(device, dtype) and encoded.encoding in cpu_ops.GGUF_PACKED_FORMATS:
                self.encoding = encoded.encoding
            table.release_file_pages()
        else:
            codes = table.q.view(torch.uint8) if table.bits == 8 else _pack_nibbles(table.q)
            self.codes = nn.Parameter(codes.to(device), requires_grad=False)
            self.scales = nn.Parameter(table.scales.to(device), requires_grad=False)
            mins = table.mins
            self.mins = None if mins is None else nn.Parameter(mins.to(device), requires_grad=False)
        self.bits = table.bits
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
        self.quantized = None
        self.weight_format = table.format
        self._dtype = dtype

    def dequantize_into_weight(self, dtype: torch.dtype) -> None:
        """The float table from the quantized one (--quantization none, or no kernel)."""
        assert self.quantized is not None
        self.weight.data.copy_(self.quantized.dequantize(dtype))  # in place: a tied head shares it
        self.quantized = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.weight_format:
            return nn.functional.embedding(input_ids, self.weight)
        if self.encoding:
            return cpu_ops.gguf_rows(self.raw, input_ids, self.encoding, self.hidden_size).to(self._dtype)
        if self.decode is not None:
            return self.decode(self.raw.index_select(0, input_ids)).dequantize(self._dtype)
        codes = self.codes.index_select(0, input_ids)
        q = codes.view(torch.int8) if self.bits == 8 else _unpack_nibbles(codes)
        num, hidden = q.shape
        blocks = q.view(num, hidden // BLOCK, BLOCK).float() * self.scales.index_select(
            0, input_ids
        ).unsqueeze(-1)
        if self.mins is not None:
            blocks = blocks + self.mins.index_select(0, input_ids).unsqueeze(-1)
        return blocks.view(num, hidden).to(self._dtype)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (0..15) -> [N, K / 2] bytes, code 2i in the low half of byte i."""
    pairs = q.to(torch.uint8).view(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def _unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack((codes & 15, codes >> 4), dim=-1).view(codes.shape[0], -1).to(torch.int8)
