"""KV cache sizing and allocation: bytes per token, blocks from a memory budget, the tensors.

    bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes)

Scale bytes are 0 for float caches and 2 (one float16 per token and KV head) for 8-bit ones,
see attention/kv_quant.py. The planner (`pagedllm plan`) and the engine both size the cache
with `KVCacheSpec`, so the figures it prints are exactly what the engine allocates.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from pagedllm.attention.kv_quant import KV_CACHE_DTYPES, SCALE_BYTES
from pagedllm.host_pages import fresh_pages
from pagedllm.model.config import ModelConfig

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_ALIASES = {"fp8": "fp8_e4m3"}  # as in vLLM


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The cache dtype for a --kv-cache-dtype value: `auto` keeps the model dtype, `fp8` is e4m3."""
    return model_dtype if kv_cache_dtype == "auto" else _ALIASES.get(kv_cache_dtype, kv_cache_dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: str  # float32 | bfloat16 | float16 | int8 | fp8_e4m3 | fp8_e5m2

    @classmethod
    def for_model(
        cls, config: ModelConfig, block_size: int, cache_dtype: str, tp_size: int = 1
    ) -> KVCacheSpec:
        """One rank's cache: with tensor parallelism it holds num_kv_heads / tp_size heads."""
        if cache_dtype not in _ELEMENT_BYTES:
            raise ValueError(
                f"kv_cache_dtype: {cache_dtype!r} is not a KV cache dtype; "
                "use auto, int8, fp8, fp8_e4m3 or fp8_e5m2"
            )
        if cache_dtype in KV_CACHE_DTYPES and config.head_dim % 2:
            raise ValueError(
                f"kv_cache_dtype: {cache_dtype} packs a float16 scale after head_dim values, which needs "
                f"an even head_dim, not {config.head_dim}; use auto"
            )
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads // tp_size,
            config.head_dim,
            block_size,
            cache_dtype,
        )

    @property
    def is_quantized(self) -> bool:
        return self.cache_dtype in KV_CACHE_DTYPES

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.cache_dtype]

    @property
    def scale_bytes_per_row(self) -> int:
        """Scale bytes packed after each (token, KV head) row: 0 for float caches."""
        return SCALE_BYTES if self.is_quantized else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) for one KV head, its scale included."""
        return self.head_dim * self.element_bytes + self.scale_bytes_per_row

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def scale_bytes_per_token(self) -> int:
        """The scales' share of bytes_per_token (0 for float caches)."""
        return 2 * self.num_layers * self.num_kv_heads * self.scale_bytes_per_row

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block

    def blocks_per_sequence(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed [num_blocks, block_size, kv_heads, row] K and V per layer, carved from a
    single allocation; row is head_dim, or head_dim + 2 scale bytes for an 8-bit cache (whose
    tensor dtype, int8 or float8, says how to read it). Zeroed, not empty: padding slots are
    read (then masked) by batched attention, and masked garbage that happens to be NaN would
    still poison the sum; zero bytes read back as 0.0 in every format."""
    dtype = KV_CACHE_DTYPES[spec.cache_dtype] if spec.is_quantized else getattr(torch, spec.cache_dtype)
    row = spec.head_dim + spec.scale_bytes_per_row  # elements: one byte each when quantized
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, row)
    if device.type == "cpu" and hasattr(mmap, "MAP_ANONYMOUS"):
        storage = fresh_pages(num_blocks * spec.bytes_per_block).view(dtype).view(shape)
    else:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[i, 0], storage[i, 1]) for i in range(spec.num_layers)]


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV budget turns into blocks and tokens; what the startup report prints."""

    spec: KVCacheSpec
    budget_bytes: int
    num_blocks: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once."""
        return self.num_tokens / self.max_model_len

    @property
    def allocated_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def describe(self, tp_size: int = 1, on_cuda: bool = False) -> list[str]:
        """The start-up report's KV cache lines, in the words vLLM users grep for ("KV cache
        size", "Maximum concurrency"); with tensor parallelism, this rank's share and the total."""
        per_rank = " per rank" if tp_size > 1 else ""
        scales = self.spec.scale_bytes_per_token
        lines = [
            f"Available KV cache memory: {self.budget_bytes / 2**30:.2f} GiB{per_rank}",
            f"KV cache: {self.num_blocks:,} blocks of {self.spec.block_size} tokens, "
            f"{self.spec.bytes_per_token:,} bytes per token ({self.spec.cache_dtype}"
            f"{f', {scales:,} of them scales' if scales else ''})",
            f"{'GPU ' if on_cuda else ''}KV cache size: {self.num_tokens:,} tokens",
        ]
        if tp_size > 1:  # every rank holds num_kv_heads / tp_size of the model's heads
            lines.append(
                f"KV cache per rank: {self.num_tokens:,} tokens ({self.num_blocks:,} blocks, "
                f"{self.allocated_bytes / 2**30:.2f} GiB, {self.spec.num_kv_heads} of "
                f"{self.spec.num_kv_heads * tp_size} KV heads); total over {tp_size} ranks: "
                f"{self.allocated_bytes * tp_size / 2**30:.2f} GiB"
            )
        lines.append(
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )
        return lines


def plan_kv_cache(
    spec: KVCacheSpec, budget_bytes: int, max_model_len: int, num_blocks_override: int | None = None
) -> KVCachePlan:
    """Blocks for a budget (or the override), checked against one max_model_len request.

    Raises ValueError saying what to change when not even one request of max_model_len fits.
    """
    num_blocks = num_blocks_override or spec.num_blocks_for(budget_bytes)
    needed = spec.blocks_per_sequence(max_model_len)
    if num_blocks < needed:
        have = f"{num_blocks:,} blocks" + (
            "" if num_blocks_override else f" fit in {budget_bytes / 2**30:.2f} GiB"
        )
        raise ValueError(
            f"max_model_len {max_model_len:,} needs {needed:,} KV cache blocks of {spec.block_size} tokens "
            f"({needed * spec.bytes_per_block / 2**30:.2f} GiB) but only {have}; lower --max-model-len "
            "or raise --kv-cache-memory-bytes (CUDA: --gpu-memory-utilization)"
        )
    return KVCachePlan(spec, budget_bytes, num_blocks, max_model_len)
