"""The attention backend: how every layer's attention runs, chosen once per model runner.

select_backend looks at the device, the model's dtype, the cache's dtype and head_dim once;
the backend it returns builds each step's AttentionMetadata and runs each layer's rotary, K/V
write and attention over the paged cache. The model calls an Attention (its heads) and never
asks which path it is on.

- CpuKernelBackend: the C++ kernels (kernels/cpu_ops.py) on CPU. With a cache of the model's
  dtype, one pass rotates queries and keys and writes K/V into their slots; then one call of
  the paged attention kernel takes every token of the step, prefetching the cache rows into L1
  or L2 as timed on this host (row_prefetch.py).
- TorchBackend: PyTorch ops on any device: rotary, write_kv, then gather + SDPA
  (paged_attention.py).

Rotary is applied here, not in the model, because on CPU it is fused with the K/V write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata, PagedKernelInput, StepLayout, build_torch_metadata
from pagedllm.attention.paged_attention import paged_attention, write_kv
from pagedllm.attention.row_prefetch import prefetch_to_l2
from pagedllm.kernels import cpu_ops

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_dim]
CosSin = tuple[
    torch.Tensor, torch.Tensor
]  # rotary tables of this step's positions, [num_tokens, 1, head_dim]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim], queries and keys together (one set of ops for both).
    Hugging Face computes x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; here
    [x2, x1] (a roll) times a sin table whose first half is negated: (-x2) * s and x2 * (-s) are
    the same number, so the result is bit for bit the same, in four ops instead of twelve."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass(frozen=True)
class Attention:
    """One layer's attention heads (this rank's share); calling it runs the step's backend."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None = None
    """A sliding-window layer's keys per query, its own included; None: every earlier key."""

    def __call__(
        self, qkv: torch.Tensor, rope: CosSin, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """qkv: [num_tokens, (num_heads + 2 num_kv_heads) * head_dim], the fused projection.
        Returns [num_tokens, num_heads, head_dim]."""
        assert metadata.backend is not None  # the runner's metadata always names its backend
        return metadata.backend.forward(self, qkv, rope, kv_cache, metadata)


class AttentionBackend(ABC):
    """Builds a step's attention metadata and runs every layer's attention on it."""

    name: str

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the model's

    @abstractmethod
    def build_metadata(self, layout: StepLayout, device: torch.device) -> AttentionMetadata:
        """The step's metadata for this path, shared by every layer."""

    @abstractmethod
    def forward(
        self,
        layer: Attention,
        qkv: torch.Tensor,
        rope: CosSin,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotate, write this step's K/V, attend: [num_tokens, num_heads, head_dim]."""


class CpuKernelBackend(AttentionBackend):
    name = "C++ kernel reading the paged KV cache in place (decodes and prefills)"

    def __init__(self, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> None:
        super().__init__(dtype)
        # rotary and the K/V write fused in one pass where the cache holds the model's dtype
        self.fuses_rotary_write = cache_dtype == dtype
        self.prefetch_to_l2 = prefetch_to_l2(dtype, cache_dtype, head_dim)

    def build_metadata(self, layout: StepLayout, device: torch.device) -> AttentionMetadata:
        # one call takes every token: no groups, spans or masks to build
        query_start_loc = torch.tensor([*layout.row_offsets, layout.slot_mapping.shape[0]])
        kernel = PagedKernelInput(layout.block_tables, query_start_loc, torch.tensor(layout.seq_lens))
        return AttentionMetadata(layout.slot_mapping.to(device), [], [], kernel, self)

    def forward(
        self,
        layer: Attention,
        qkv: torch.Tensor,
        rope: CosSin,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        kernel = metadata.kernel
        assert kernel is not None
        if self.fuses_rotary_write:
            query = cpu_ops.rotary_write_kv(
                qkv, *rope, metadata.slot_mapping, *kv_cache, layer.num_heads, layer.num_kv_heads
            )
        else:  # an 8-bit cache: write_kv quantizes the rows
            query, key, value = _rotate_split(layer, qkv, rope)
            write_kv(*kv_cache, key, value, metadata.slot_mapping)
        return cpu_ops.paged_attention(
            query,
            *kv_cache,
            kernel.block_tables,
            kernel.query_start_loc,
            kernel.seq_lens,
            layer.scale,
            self.prefetch_to_l2,
            layer.window,
        )


class TorchBackend(AttentionBackend):
    name = "PyTorch ops (gather + SDPA)"

    def build_metadata(self, layout: StepLayout, device: torch.device) -> AttentionMetadata:
        metadata = build_torch_metadata(layout, device, self.dtype)
        metadata.backend = self
        return metadata

    def forward(
        self,
        layer: Attention,
        qkv: torch.Tensor,
        rope: CosSin,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        query, key, value = _rotate_split(layer, qkv, rope)
        return paged_attention(query, key, value, *kv_cache, metadata, layer.scale, layer.window)


def _rotate_split(
    layer: Attention, qkv: torch.Tensor, rope: CosSin
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries [num_tokens, num_heads, head_dim] and keys [num_tokens, num_kv_heads, head_dim],
    rotated together, and values [num_tokens, num_kv_heads, head_dim]."""
    num_tokens = qkv.shape[0]
    qk_size = (layer.num_heads + layer.num_kv_heads) * layer.head_dim
    qk = apply_rotary(qkv[:, :qk_size].view(num_tokens, -1, layer.head_dim), *rope)
    query, key = qk.split([layer.num_heads, layer.num_kv_heads], dim=1)
    value = qkv[:, qk_size:].view(num_tokens, layer.num_kv_heads, layer.head_dim)
    return query, key, value


def select_backend(
    device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int
) -> AttentionBackend:
    """The C++ kernels where they serve this model and cache on this device, else PyTorch ops."""
    if cpu_ops.serves(device, dtype, cache_dtype, head_dim):
        return CpuKernelBackend(dtype, cache_dtype, head_dim)
    return TorchBackend(dtype)
