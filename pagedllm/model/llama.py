"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) over a flat, ragged token layout.

All tokens of a step, from all requests, are one [num_tokens, hidden_size] matrix: no padding,
no batch dimension. Only attention needs to know where one request ends and the next begins,
and it learns that from AttentionMetadata. Numerics follow Hugging Face's implementation
step by step (RMSNorm in float32, rotate-half RoPE) so float32 outputs match it: bit for bit in
PyTorch ops; on CPU, where the C++ passes and kernels sum in their own order, within a few float32
roundings, and greedy tokens the same (tests/test_correctness_hf.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import Attention, CosSin, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import cpu_ops
from pagedllm.model.config import ModelConfig
from pagedllm.model.linear import Linear
from pagedllm.model.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    """RMSNorm that also adds the residual first when given one (returns the new residual)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if cpu_ops.serves_layer_ops(x):  # on CPU: one C++ pass instead of up to nine ops
            return cpu_ops.add_rms_norm(x.contiguous(), residual, self.weight, self.eps)
        if residual is not None:
            x = residual + x
        residual = x
        if x.dtype == torch.float32:  # one fused kernel, bit-identical to the steps below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), residual


def _all_reduce(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """A row-parallel projection's partial sums, summed over the ranks (nothing with one rank)."""
    return x if tp is None else tp.all_reduce(x)


class LlamaAttention(nn.Module):
    """With tensor parallelism each rank owns num_heads / tp and num_kv_heads / tp whole heads:
    qkv_proj is split by output rows (column-parallel), o_proj by input columns (row-parallel),
    and the ranks' o_proj outputs are summed."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None) -> None:
        super().__init__()
        tp_size = tp.world_size if tp is not None else 1
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size // tp_size, config.kv_size // tp_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # rotary, the K/V write and paged attention: the step's backend (attention/backend.py)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        out = self.attn(qkv, rope, kv_cache, metadata)  # [num_tokens, num_heads, head_dim]
        return _all_reduce(self.o_proj(out.view(num_tokens, self.q_size)), self.tp)


class LlamaMLP(nn.Module):
    """Tensor parallel: gate_up_proj column-parallel, down_proj row-parallel, outputs summed."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size // (tp.world_size if tp is not None else 1)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_ops.serves_layer_ops(gate_up):  # on CPU: one C++ pass instead of three ops
            activated = cpu_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            activated = F.silu(gate) * up
        return _all_reduce(self.down_proj(activated), self.tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, rope: CosSin, hidden, residual, kv_cache: KVCache, metadata: AttentionMetadata):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """`tp`: this rank's group, or None for one rank. The layers' projections are split;
    embeddings and norms are whole on every rank; the LM head is split by vocabulary rows where
    the ranks divide the vocabulary (each rank computes its logits, rank 0 gathers them and
    samples), else whole on every rank and computed by rank 0 alone."""

    def __init__(self, config: ModelConfig, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.vocab_parallel = tp is not None and config.vocab_size % tp.world_size == 0
        vocab_per_rank = config.vocab_size // tp.world_size if self.vocab_parallel else config.vocab_size
        self.rotary = RotaryEmbedding(config, max_position)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, vocab_per_rank, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if not self.config.tie_word_embeddings:
            return
        if self.vocab_parallel:
            assert self.tp is not None
            rows = self.lm_head.out_features
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.narrow(0, self.tp.rank * rows, rows))
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def pack_weights(self) -> int:
        """Pack every projection for the few-rows kernel or oneDNN, where that pays (linear.py).
        Returns the bytes this adds: a tied lm_head gets its own packed copy, since the embedding
        lookup needs the plain one."""
        added = 0
        computes_head = self.tp is None or self.tp.is_driver or self.vocab_parallel
        for module in self.modules():
            if module is self.lm_head and not computes_head:
                continue  # never computed here: rank 0 alone computes logits
            if isinstance(module, Linear):
                shared = module is self.lm_head and self.config.tie_word_embeddings
                before = module.weight
                module.pack_weight()
                if shared and module.weight is not before:
                    added += before.numel() * before.element_size()
        return added

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden_size],
        before the final norm (applied in compute_logits to the sampled rows only)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]; with a
        vocabulary-parallel head every rank calls it and rank 0 alone gets them (others: None)."""
        normed, _ = self.norm(hidden)
        logits = self.lm_head(normed).float()
        if not self.vocab_parallel:
            return logits
        assert self.tp is not None
        return self.tp.gather_columns(logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive; with
        tensor parallelism each rank copies only its slice of the split projections."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tp_size = self.tp.world_size if self.tp is not None else 1
        for hf_name, tensor in weights:
            name, offset, split_dim = _our_name(hf_name, self.config)
            if name is None:
                continue
            if name == "lm_head.weight" and self.vocab_parallel:
                split_dim = 0
            if self.tp is not None and split_dim is not None:
                tensor = tensor.chunk(tp_size, split_dim)[self.tp.rank]
                offset = None if offset is None else offset // tp_size  # within this rank's fused rows
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param = params[name]
            target = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
            if target.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(hf_name)
        missing = _expected_hf_names(self.config) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


_ROW_PARALLEL = (".self_attn.o_proj.", ".mlp.down_proj.")


def _our_name(hf_name: str, config: ModelConfig) -> tuple[str | None, int | None, int | None]:
    """Map a Hugging Face tensor name to (our parameter, row offset inside a fused one, the
    dimension tensor parallelism splits: 0 for column-parallel, 1 for row-parallel, None if
    replicated)."""
    if "rotary_emb" in hf_name:
        return None, None, None
    name = hf_name.removeprefix("model.")
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", config.q_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", config.q_size + config.kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", config.intermediate_size),
    }
    for hf_part, (our_part, offset) in fused.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, our_part), offset, 0
    return name, None, 1 if any(part in name for part in _ROW_PARALLEL) else None


def _expected_hf_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    projections = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names.update(prefix + p + ".weight" for p in projections)
        names.update(prefix + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm"))
        if config.attention_bias:
            names.update(prefix + f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj"))
    return names
