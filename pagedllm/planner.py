"""Capacity planning from a model's config alone: how many tokens and requests the KV cache holds.

    bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes)
    KV budget       = --kv-cache-memory-bytes, or device memory x utilization - weights - overhead
    blocks          = KV budget // (bytes per token x block_size);  tokens = blocks x block_size
    max concurrency = tokens / max_model_len

The arithmetic is the engine's own (KVCacheSpec, plan_kv_cache), so for the same model and
budget the planner's blocks are the blocks the engine allocates. No weight is loaded: an HF
folder (or hub name) gives its config.json, a GGUF its metadata, or the shape is given by numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.config import DEFAULT_CPU_KV_CACHE_BYTES
from pagedllm.layers.quantization import packed_bits_per_weight
from pagedllm.model.checkpoint_quant import CheckpointQuantization
from pagedllm.model.config import ModelConfig
from pagedllm.model.config_reader import model_config_from_dict, model_config_from_folder
from pagedllm.model.gguf_convert import gguf_hf_config
from pagedllm.model.locate import locate_model, resolve_dtype
from pagedllm.quantization.registry import QUANTIZATION_METHODS
from pagedllm.worker.kv_cache import KVCachePlan, KVCacheSpec, plan_kv_cache, resolve_cache_dtype

WHAT_IF_MAX_MODEL_LENS = (1024, 2048, 4096)  # and the model's own maximum
WHAT_IF_KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # fp8_e5m2 has fp8_e4m3's size
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_model_config(
    model: str | None, *, revision: str | None = None, download_dir: str | None = None
) -> ModelConfig:
    """The config of an HF folder, a GGUF file or a hub name (None: the default model), reading no
    weights; a hub name downloads only its config unless the repo is GGUF only."""
    try:
        path = locate_model(model, revision=revision, download_dir=download_dir, weights=False)
    except FileNotFoundError as error:
        hint = "or describe the model by numbers (--layers, --hidden-size, ...)"
        raise FileNotFoundError(f"{error}; {hint}") from None
    if path.suffix == ".gguf":
        return model_config_from_dict(gguf_hf_config(path))
    return model_config_from_folder(path)


def config_from_numbers(
    *,
    layers: int,
    hidden_size: int,
    num_heads: int,
    intermediate_size: int,
    vocab_size: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
) -> ModelConfig:
    """A Llama-shaped config from its sizes, e.g. the classic 7B: 32, 4096, 32, 11008, 32000;
    checked as a file's config is, the errors naming the flags."""
    return model_config_from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": layers,
            "hidden_size": hidden_size,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads or num_heads,
            "head_dim": head_dim,  # None: hidden / heads, once checked that they divide
            "intermediate_size": intermediate_size,
            "vocab_size": vocab_size,
            "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": tie_word_embeddings,
        },
        source="the model given by numbers",
        names=_NUMBER_FLAGS,
    )


_NUMBER_FLAGS = {
    "num_hidden_layers": "--layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-heads",
    "num_key_value_heads": "--num-kv-heads",
    "head_dim": "--head-dim",
    "intermediate_size": "--intermediate-size",
    "vocab_size": "--vocab-size",
    "max_position_embeddings": "--max-position-embeddings",
}


def gguf_weights_by_format(path: Path, dtype: str) -> dict[str, int]:
    """Resident weight bytes by format for a GGUF served with its own blocks, from the tensor
    directory alone (the file is memory-mapped, no weight is read): quantized matrices as the
    integer kernel packs them, the quantized embedding as the file stores it (read out as looked
    up) plus its packed copy for a tied LM head, float tensors in `dtype`."""
    import gguf

    from pagedllm.model.gguf_file import read_tensor_directory
    from pagedllm.model.gguf_weights import held_form

    tensors = read_tensor_directory(path)
    names = {tensor.name for tensor in tensors}
    by_format: dict[str, int] = {}

    def add(name: str, size: float) -> None:
        by_format[name] = by_format.get(name, 0) + int(size)

    for tensor in tensors:
        kind, count = tensor.tensor_type.name, int(np.prod(tensor.shape))
        if kind in ("F32", "F16", "BF16") or len(tensor.shape) not in (2, 3):  # 3: a layer's experts
            if tensor.name != "rope_freqs.weight":
                add(dtype, count * _DTYPE_BYTES[dtype])
            continue
        resident, bits, has_mins = held_form(tensor.tensor_type)
        packed = packed_bits_per_weight(bits, has_mins) * count / 8
        if tensor.name == "token_embd.weight":
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            add(resident, count // block_size * type_size)
            if "output.weight" not in names:
                add(resident, packed)  # the tied head's packed copy
        else:
            add(resident, packed)
    return by_format


def weights_by_format(
    model_config: ModelConfig,
    dtype: str,
    quantization: str | None,
    tp_size: int = 1,
    checkpoint: CheckpointQuantization | None = None,
) -> dict[str, int]:
    """Resident weight bytes by format for a safetensors checkpoint: all in `dtype`; or every
    projection but the LM head packed for the integer kernel, quantized at load (--quantization
    int8/int4) or as the checkpoint holds them (AWQ, GPTQ, compressed-tensors, FP8: its first
    scheme's bits, unless --quantization none)."""
    total = model_config.num_parameters(tp_size)
    projections = model_config.projection_parameters(tp_size)
    bits = QUANTIZATION_METHODS[quantization].bits_at_load() if quantization else None
    if quantization and bits is not None:
        name = quantization
    elif checkpoint is not None and quantization != "none":
        scheme = checkpoint.groups[0][1]
        name, bits = checkpoint.format(scheme), scheme.packed_bits
    else:
        bits = None
    if bits is None:
        return {dtype: total * _DTYPE_BYTES[dtype]}
    return {name: int(projections * bits / 8), dtype: (total - projections) * _DTYPE_BYTES[dtype]}


@dataclass(frozen=True)
class MemoryBudget:
    """Where the KV budget comes from, as in Worker.kv_cache_budget_bytes: an explicit size, else a
    device's memory x utilization less weights and overhead (activation peak and memory outside
    torch, which the engine measures at start-up and a planner can only be told), else CPU's 4 GiB."""

    kv_cache_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    overhead_bytes: int = 0

    def kv_cache_bytes(self, weights_bytes: int) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if self.device_memory_bytes is None:
            return DEFAULT_CPU_KV_CACHE_BYTES
        usable = int(self.device_memory_bytes * self.gpu_memory_utilization)
        budget = usable - weights_bytes - self.overhead_bytes
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: {usable / 1e9:.2f} GB usable "
                f"({self.device_memory_bytes / 1e9:.2f} GB x {self.gpu_memory_utilization}) minus "
                f"{weights_bytes / 1e9:.2f} GB of weights and {self.overhead_bytes / 1e9:.2f} GB overhead; "
                "use a larger device, a smaller --dtype or raise --gpu-memory-utilization"
            )
        return budget


@dataclass(frozen=True)
class CapacityPlan:
    model_name: str
    model_config: ModelConfig
    dtype: str  # weights and activations
    budget: MemoryBudget
    kv: KVCachePlan
    """One rank's cache (with tensor parallelism every rank holds the same blocks)."""
    what_if: list[KVCachePlan]  # max_model_len x KV cache dtype, max_model_len-major
    weights_by_format: dict[str, int]
    """Resident weight bytes by how they are held (one rank's)."""
    tensor_parallel_size: int = 1
    shared_prefix_tokens: int = 0
    """A prefix every request shares (a fixed system prompt), held in the cache once."""

    @property
    def num_parameters(self) -> int:
        """One rank's (all of them with one rank)."""
        return self.model_config.num_parameters(self.tensor_parallel_size)

    @property
    def active_parameters(self) -> int:
        """One rank's parameters a token's forward pass uses (a mixture of experts': its routed
        experts only; a dense model's: all)."""
        return self.model_config.active_parameters(self.tensor_parallel_size)

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_by_format.values())

    @property
    def decode_step_weight_bytes(self) -> int:
        """About what one request's decode step reads of the weights: their bytes in the share of
        active parameters (a mixture of experts' routed experts and every other weight; all of a
        dense model's). A CPU decode step's time is about these bytes over the memory's rate."""
        return self.weights_bytes * self.active_parameters // self.num_parameters

    @property
    def max_concurrency_with_shared_prefix(self) -> float:
        """Requests of max_model_len at once when the first shared_prefix_tokens of each are one
        cached copy (its whole blocks shared; a partial last block is each request's own)."""
        block = self.kv.spec.block_size
        shared = self.shared_prefix_tokens // block * block
        return max(0, self.kv.num_tokens - shared) / (self.kv.max_model_len - shared)

    def as_dict(self) -> dict[str, Any]:
        """Every figure, with self-explanatory keys (what `pagedllm plan --json` prints)."""
        config = self.model_config
        return {
            "model": self.model_name,
            "architecture": config.architecture,
            "num_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "max_position_embeddings": config.max_position_embeddings,
            "dtype": self.dtype,
            "num_parameters": self.num_parameters,
            "active_parameters_per_token": self.active_parameters,
            "decode_step_weight_bytes": self.decode_step_weight_bytes,
            "weights_bytes": self.weights_bytes,
            "weights_bytes_by_format": self.weights_by_format,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "max_concurrency_with_shared_prefix": self.max_concurrency_with_shared_prefix,
            "device_memory_bytes": self.budget.device_memory_bytes,
            "gpu_memory_utilization": self.budget.gpu_memory_utilization
            if self.budget.device_memory_bytes is not None
            else None,
            "overhead_bytes": self.budget.overhead_bytes,
            "kv_cache_memory_bytes": self.kv.budget_bytes,
            "tensor_parallel_size": self.tensor_parallel_size,
            "kv_cache_allocated_bytes_all_ranks": self.kv.allocated_bytes * self.tensor_parallel_size,
            **_kv_figures(self.kv),
            "what_if": [_kv_figures(p) for p in self.what_if],
        }


def plan_capacity(
    model_config: ModelConfig,
    model_name: str,
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    max_model_len: int | None = None,
    budget: MemoryBudget | None = None,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    gguf_path: Path | None = None,
    checkpoint: CheckpointQuantization | None = None,
    shared_prefix_tokens: int = 0,
) -> CapacityPlan:
    """Blocks, tokens and concurrency for one setting, plus the what-if grid. With tensor
    parallelism the weights, the budget and the cache are one rank's, as the engine sizes them.

    `dtype` auto is what the engine would pick: bfloat16 on a GPU (a budget with device memory),
    on this CPU what the engine picks here. Raises ValueError where the engine would refuse to
    start for other reasons than fit (max_model_len over the model's, no memory left).
    """
    model_config.check_tensor_parallel_size(tensor_parallel_size)
    budget = budget or MemoryBudget()
    on_gpu = budget.device_memory_bytes is not None and budget.kv_cache_memory_bytes is None
    model_dtype = dtype if dtype != "auto" else _auto_dtype(on_gpu)
    model_max = model_config.resolve_max_model_len(None)
    served_len = model_config.resolve_max_model_len(max_model_len)  # ValueError as the engine's
    if gguf_path is not None and quantization != "none":
        if tensor_parallel_size > 1:
            raise ValueError("plan: a GGUF's own formats are planned for one rank; give --quantization none")
        by_format = gguf_weights_by_format(gguf_path, model_dtype)
    else:
        by_format = weights_by_format(
            model_config, model_dtype, quantization, tensor_parallel_size, checkpoint
        )
    kv_bytes = budget.kv_cache_bytes(sum(by_format.values()))
    if not 0 <= shared_prefix_tokens < served_len:
        raise ValueError(
            f"--shared-prefix-tokens {shared_prefix_tokens}: must be below max_model_len {served_len}"
        )

    def kv_plan(cache: str, length: int) -> KVCachePlan:
        cache_dtype = resolve_cache_dtype(cache, model_dtype)
        spec = KVCacheSpec.for_model(model_config, block_size, cache_dtype, tensor_parallel_size)
        try:
            return plan_kv_cache(spec, kv_bytes, length)
        except ValueError:  # not one request fits: still worth showing how far off it is
            return KVCachePlan(spec, kv_bytes, spec.num_blocks_for(kv_bytes), length)

    lengths = sorted({n for n in WHAT_IF_MAX_MODEL_LENS if n < model_max} | {model_max})
    return CapacityPlan(
        model_name=model_name,
        model_config=model_config,
        dtype=model_dtype,
        budget=budget,
        kv=kv_plan(kv_cache_dtype, served_len),
        what_if=[kv_plan(cache, n) for n in lengths for cache in WHAT_IF_KV_CACHE_DTYPES],
        weights_by_format=by_format,
        tensor_parallel_size=tensor_parallel_size,
        shared_prefix_tokens=shared_prefix_tokens,
    )


def fits(plan: KVCachePlan) -> bool:
    """Whether one request of max_model_len fits (else the engine refuses to start)."""
    return plan.num_blocks >= plan.spec.blocks_per_sequence(plan.max_model_len)


def _kv_figures(plan: KVCachePlan) -> dict[str, Any]:
    spec = plan.spec
    return {
        "kv_cache_dtype": spec.cache_dtype,
        "block_size": spec.block_size,
        "bytes_per_element": spec.element_bytes,
        "bytes_per_token": spec.bytes_per_token,
        "scale_bytes_per_token": spec.scale_bytes_per_token,
        "num_blocks": plan.num_blocks,
        "kv_cache_tokens": plan.num_tokens,
        "kv_cache_allocated_bytes": plan.allocated_bytes,
        "max_model_len": plan.max_model_len,
        "max_concurrency": plan.max_concurrency,
        "fits": fits(plan),
    }


def _auto_dtype(on_gpu: bool) -> str:
    if on_gpu:
        return "bfloat16"  # the engine's choice on every GPU with bfloat16 (Ampere and later)
    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
