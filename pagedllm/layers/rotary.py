"""Rotary position embedding, computed as Hugging Face does (rotate-half), so float32 runs
match transformers bit for bit. cos/sin are tabulated once for every position up to
max_model_len and indexed by each token's position."""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedllm.layers.direct_call import DirectCall


def inverse_frequencies(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    rope_freq_factors: tuple[float, ...] | None,
) -> torch.Tensor:
    """Per-pair inverse frequencies after rope scaling: [head_dim / 2]. Arguments as
    ModelConfig names them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope_freq_factors, dtype=torch.float32)
    if rope_scaling is None:
        return inv_freq
    kind = rope_scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear and llama3 are)")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(DirectCall, torch.nn.Module):
    cos_cache: torch.Tensor  # [max_position, head_dim]
    sin_cache: torch.Tensor  # [max_position, head_dim], its first half negated

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
        rope_freq_factors: tuple[float, ...] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.rope_freq_factors = rope_freq_factors
        self.register_buffer("cos_cache", torch.empty(max_position, head_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_position, head_dim), persistent=False)
        if not self.cos_cache.is_meta:
            self.compute_cache()

    def compute_cache(self) -> None:
        """Fill the cos/sin tables (computed in float32, stored in the model dtype, as Hugging
        Face casts them before use). The sin table's first half is stored negated: see
        attention/backend.py's apply_rotary."""
        inv_freq = inverse_frequencies(
            self.head_dim, self.rope_theta, self.rope_scaling, self.rope_freq_factors
        )
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        self.cos_cache = emb.cos().to(self.cos_cache.dtype).to(self.cos_cache.device)
        self.sin_cache = sin.to(self.sin_cache.dtype).to(self.sin_cache.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and (half-negated) sin for each token, [num_tokens, 1, head_dim]; looked up once
        per step."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)
