"""The CPU kernels (csrc/: paged attention; residual add + RMSNorm, rotary +
KV-cache write and SiLU-and-multiply; projections from weights packed for decode steps, bf16/fp32
or quantized to 4 or 8 bits; greedy sampling's argmax; LoRA adapters' shrink and expand),
compiled on first use into one library,
registered as torch.ops.pagedllm.* and, for the calls a step makes over and over, bound directly
as a Python module (csrc/python_bindings.cpp: a call costs about a microsecond less).

torch's C++ extension loader builds it with the machine's compiler and ninja, for this very CPU
(-march=native; PAGEDLLM_CPU_MARCH names another), into torch's extension cache
(TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions). The library is named after everything
that decides its bits: the CPU's instruction sets, the sources and headers, the flags, torch and
Python. Two checkouts or virtualenvs on one machine therefore never overwrite each other's build
(each would rebuild at every start otherwise), and identical trees share one (compiled from a copy
of the sources in the build folder, so their own paths do not differ in ninja's commands). A build
is announced with its time (under a minute: the kernel files compile as two translation units, one
per core, beside the bindings). `make setup` builds it once, so the first server start does not
wait.
Where it cannot be built (no compiler), attention keeps the PyTorch path (gather + SDPA), with
a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name for name in ("unity_projections.cpp", "unity_attention_layers.cpp", "python_bindings.cpp")
]
"""What is compiled: the kernel files in two translation units of about equal build time (each
includes its files; one per core), and the bindings."""
MARCH_VARIABLE = "PAGEDLLM_CPU_MARCH"
"""The compiler's -march for the kernels instead of `native`: a CPU kind older than this one that
it can run (gcc's names: x86-64, x86-64-v3 for AVX2, x86-64-v4 for AVX-512), to build and test
the kernels as a host of that kind gets them (tests/kernels/test_forced_isa.py)."""
_LDFLAGS = ["-fopenmp"]
_CACHE_DTYPES = {
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
}
_QUERY_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


def _march() -> str:
    march = os.environ.get(MARCH_VARIABLE, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}", march):
        raise ValueError(f"{MARCH_VARIABLE}={march!r} is not a compiler CPU name (e.g. x86-64-v3)")
    return march


def _cflags() -> list[str]:
    return ["-O3", f"-march={_march()}", "-fno-trapping-math", "-fopenmp"]


ISA_LEVELS = ("plain C++ loops", "AVX2 + FMA", "AVX-512", "AVX-512 + BF16")
"""cpu_types.h's PAGEDLLM_CPU_ISA, 0 to 3, by name."""
BYTE_PRODUCTS = ("AVX2 byte products", "AVX-VNNI", "AVX512-VNNI")
"""cpu_types.h's PAGEDLLM_CPU_VNNI, 0 to 2: how the integer kernel multiplies bytes."""


def instruction_set_levels() -> tuple[int, int] | None:
    """cpu_types.h's (PAGEDLLM_CPU_ISA, PAGEDLLM_CPU_VNNI) as the kernels were built; None
    without a build."""
    if not is_built():
        return None
    isa, vnni = torch.ops.pagedllm.instruction_sets()
    return isa, vnni


def describe_levels(isa: int, vnni: int) -> str:
    return ISA_LEVELS[isa] + (f", {BYTE_PRODUCTS[vnni]}" if isa else "")


def describe_build() -> str:
    """The start-up line's words for what the kernels run: their instruction sets and -march."""
    levels = instruction_set_levels()
    if levels is None:
        return "not built (no compiler?): PyTorch's paths only"
    return f"{describe_levels(*levels)} (-march={_march()})"


@functools.cache
def _source_bytes() -> dict[str, bytes]:
    """The sources and headers, read once: the name is hashed from these very bytes and the
    build folder's copy is written from them, so the two cannot disagree."""
    return {path.name: path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.suffix in (".cpp", ".h")}


def build_name() -> str:
    """The library's name: a hash of what decides its bits. The CPU's instruction sets are in it
    because a -march=native build cached on another machine (a shared home, a copied image) could
    die here on an illegal instruction; the sources, headers, flags and torch's install folder
    (its headers' and libraries' paths are in ninja's commands) because torch's loader rebuilds in
    place whenever the commands differ, so two trees sharing a name take turns rebuilding."""
    digest = hashlib.sha256()
    features = " ".join(sorted(cpu_flags())) or f"{platform.machine()} {platform.processor()}"
    torch_folder = str(Path(torch.__file__).resolve().parent)
    for part in (features, " ".join(_cflags() + _LDFLAGS), torch.__version__, torch_folder, sys.version):
        digest.update(part.encode() + b"\0")
    for file_name, content in _source_bytes().items():
        digest.update(file_name.encode() + b"\0" + content + b"\0")
    return f"pagedllm_cpu_{digest.hexdigest()[:16]}"


def _build_folder(name: str) -> Path | None:
    from torch.utils import cpp_extension

    try:  # torch's own rule for the folder (TORCH_EXTENSIONS_DIR, else its cache); private API
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, OSError):
        return None


def _is_cached(name: str) -> bool:
    folder = _build_folder(name)
    # without the folder a load may be announced as a build: only the log line is wrong
    return folder is not None and (folder / f"{name}.so").exists()


def _staged_sources(name: str) -> list[Path]:
    """The sources as compiled: copied into the build folder (once; the name vouches for their
    contents), so every tree with these sources gives ninja the same commands. With each tree's
    own paths in them, two checkouts sharing the name rebuilt over each other at each start."""
    folder = _build_folder(name)
    if folder is None:
        return _SOURCES
    staged = folder / "src"
    staged.mkdir(exist_ok=True)
    for file_name, content in _source_bytes().items():
        target = staged / file_name
        if target.exists():
            continue
        # written under a private name, then linked: whole or absent, and never over another
        # process's copy (whose older mtime its objects were built against)
        fd, partial = tempfile.mkstemp(dir=staged, prefix=f".{file_name}.")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(content)
            with contextlib.suppress(FileExistsError):
                os.link(partial, target)
        finally:
            os.unlink(partial)
    return [staged / source.name for source in _SOURCES]


_BINDINGS = "python_bindings.cpp"


@functools.cache
def _library() -> ModuleType | None:
    """Build (or load the cached build of) the kernels once per process: the module of their
    direct bindings (csrc/python_bindings.cpp), with every kernel also registered as
    torch.ops.pagedllm.*. Where the bindings cannot be compiled (no Python headers: Debian's
    python3-dev), the kernels alone, built under a name of their own and called through torch.ops.
    None if neither builds."""
    name = build_name()
    building = not _is_cached(name)
    if building:
        logger.info(
            "Building the CPU kernels for this machine (first start of this source tree, under a minute) ..."
        )
    started = time.perf_counter()
    try:
        library = _load(name, _staged_sources(name), python_module=True)
    except (OSError, RuntimeError, ImportError) as err:  # no compiler or ninja, no headers, a failed build
        kernels_only = f"{name}_dispatched"
        sources = [source for source in _staged_sources(kernels_only) if source.name != _BINDINGS]
        try:
            _load(kernels_only, sources, python_module=False)
        except (OSError, RuntimeError) as kernels_err:
            logger.warning(
                "CPU attention kernel unavailable, decoding with PyTorch ops instead: %s", kernels_err
            )
            return None
        logger.warning("CPU kernels built without their direct bindings (%s); called through torch.ops", err)
        return torch.ops.pagedllm  # the same names, through the dispatcher
    if building:
        seconds = time.perf_counter() - started
        logger.info("CPU kernels built in %.1f s (%s: %s)", seconds, name, " ".join(_cflags()[:2]))
    return library


def _load(name: str, sources: list[Path], python_module: bool) -> ModuleType | None:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name,
        sources=[str(source) for source in sources],
        extra_cflags=_cflags(),  # new lists: torch appends its own flags to the lists it is given,
        extra_ldflags=list(_LDFLAGS),  # which would change build_name() once the library is loaded
        is_python_module=python_module,
    )


def is_built() -> bool:
    """Whether the kernels are built (building or loading them once per process)."""
    return _library() is not None


def _ops() -> ModuleType:
    """The kernels a step calls over and over, through their direct bindings where they built
    (a call costs about a microsecond less than through torch.ops). Only called where is_built()."""
    library = _library()
    assert library is not None
    return library


def serves(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention serves a model of this dtype and cache on this device."""
    return (
        device.type == "cpu"
        and dtype in _QUERY_DTYPES
        and cache_dtype in _CACHE_DTYPES
        and head_dim % 8 == 0
        and is_built()
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    prefetch_to_l2: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its request's cached keys (this step's K/V
    already written), or over its last `window` keys, its own included (a sliding-window layer).
    query: [num_tokens, num_heads, head_dim], each request's tokens contiguous; block_tables:
    [num_seqs, max_blocks]; query_start_loc: [num_seqs + 1] first token of each request;
    seq_lens: [num_seqs] its keys, this step's included. Returns [num_tokens, num_heads,
    head_dim] in the query's dtype (the kernel works in float32: 16-bit queries are widened as
    read, the result rounded back once). prefetch_to_l2: the cache rows are prefetched into L2
    instead of L1 (attention/row_prefetch.py times which is faster); the result is the same."""
    return _ops().paged_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, prefetch_to_l2, window or 0
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_attention for one query token per request: query [num_seqs, num_heads, head_dim]."""
    query_start_loc = torch.arange(query.shape[0] + 1, device=query.device)
    return paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) on CPU, in one call.
    x: [num_tokens, hidden]; residual: the same, or None for the first norm."""
    return _ops().add_rms_norm(x.contiguous(), residual, weight, eps)


def rms_norm_heads_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """Each query and key head of a fused [num_tokens, (num_heads + 2 num_kv_heads) * head_dim]
    projection RMS-normed in place (Qwen3's, Gemma 3's q_norm and k_norm), the same bits as
    add_rms_norm on each head's row; one call where serves_layer_ops. Returns qkv."""
    return _ops().rms_norm_heads_(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)


def serves_layer_ops(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether add_rms_norm and the act-and-mul passes serve a model of this dtype (float32, bfloat16 or
    float16) on this device (CPU)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and is_built()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused [num_tokens, 2 * intermediate] projection, in one pass, for a
    model on CPU (where serves_layer_ops); within a rounding or so of Hugging Face's two ops."""
    return _ops().silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up from a fused [num_tokens, 2 * intermediate] projection
    (Gemma's MLP), in one pass, where serves_layer_ops; within a rounding or so of PyTorch's ops."""
    return _ops().gelu_tanh_and_mul(gate_up)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for [num_rows, vocab] logits, the same answer (first largest; a
    row's first NaN where it has one); a C++ pass for contiguous float32 on CPU, ~4x PyTorch's."""
    on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if on_cpu and logits.is_contiguous() and is_built():
        return _ops().argmax_rows(logits)
    return logits.argmax(dim=-1)


def moe_align(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's (token, expert) pairs grouped by expert in one pass (csrc/moe_align_cpu.cpp):
    (experts chosen, ascending; offsets of their groups; each grouped pair's token; its weight
    [pairs, 1]; where each token's pairs went, ascending). layers/fused_moe.align_pairs is the
    same in PyTorch's ops."""
    return _ops().moe_align(topk_ids, topk_weights, num_experts)


def lora_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    groups: torch.Tensor,
    ranks: torch.Tensor,
    part_offsets: torch.Tensor,
) -> torch.Tensor:
    """Every adapter group's low-rank product added to `out` in one call (csrc/lora_cpu.cpp):
    out[rows] += (x[rows] a[slot]ᵀ) Bᵀ per group (slot, first row, end row) and per part of a
    fused projection, B held as lora_output_blocks lays it out; float32 or bfloat16 throughout.
    lora/layers.py's PyTorch path computes the same. Returns out."""
    return _ops().lora_add_(out, x, a, b, groups, ranks, part_offsets)


LORA_OUTPUT_BLOCK = 32


def lora_output_blocks(b_t: torch.Tensor, part_offsets: list[int]) -> torch.Tensor:
    """B transposed, [..., R, O], as lora_add_ reads it: each part's outputs (part_offsets) in
    blocks of LORA_OUTPUT_BLOCK from its own first block, the last padded with zeros, and within
    a block the rank rows one after another: [..., blocks, R, LORA_OUTPUT_BLOCK]."""
    blocks = []
    for first, end in itertools.pairwise(part_offsets):
        part = b_t[..., first:end]
        count = -(-(end - first) // LORA_OUTPUT_BLOCK)
        padded = torch.nn.functional.pad(part, (0, count * LORA_OUTPUT_BLOCK - (end - first)))
        blocks.append(padded.unflatten(-1, (count, LORA_OUTPUT_BLOCK)).transpose(-3, -2))
    return torch.cat(blocks, dim=-3).contiguous()


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate a fused qkv projection's queries and keys (as attention/backend.py's apply_rotary
    does, bit for bit), write keys and values into their cache slots; returns the queries
    [num_tokens, num_heads, head_dim]. qkv: [num_tokens, (num_heads + 2 num_kv_heads) * head_dim]."""
    return _ops().rotary_write_kv(
        qkv.contiguous(),
        cos.reshape(qkv.shape[0], -1),
        signed_sin.reshape(qkv.shape[0], -1),
        slot_mapping,
        k_cache,
        v_cache,
        num_heads,
        num_kv_heads,
    )


def serves_rotary_write_kv(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """A float32, bfloat16 or float16 model with a cache of the same dtype, on CPU."""
    return (
        qkv.device.type == "cpu"
        and qkv.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k_cache.dtype == qkv.dtype
        and is_built()
    )


def serves_few_rows_linear(weight: torch.Tensor) -> bool:
    """Whether few_rows_linear can take this [N, K] weight on this CPU (N a multiple of 16):
    bfloat16 with AVX512-BF16 (K even); float32 with AVX2 + FMA (AVX-512 where the CPU has it).
    Whether it should is layers/linear_dispatch.py's question, answered by timing."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % 16 or not is_built():
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and torch.ops.pagedllm.few_rows_linear_available("bfloat16")
    return weight.dtype == torch.float32 and torch.ops.pagedllm.few_rows_linear_available("float32")


def pack_few_rows(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight as few_rows_linear reads it: panels of output columns (16; float32 on an
    AVX2 CPU without AVX-512: 8), their inputs one after the other (bfloat16 in pairs, as int32)."""
    return torch.ops.pagedllm.pack_few_rows(weight)


def few_rows_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias), [M, K] -> [M, N] in x's dtype, from the packed weight: made for the few
    rows of a decode step (the weight streamed once), as fast as oneDNN for more
    (csrc/few_rows_linear_cpu.cpp)."""
    return _ops().few_rows_linear(x, packed, bias)


def serves_quant_linear(bits: int, n: int, k: int) -> bool:
    """Whether quant_linear takes a `bits`-bit (4 or 8) [n, k] weight on this CPU: any n, k a
    multiple of 32; a build with AVX2 at least (AVX512-VNNI, AVX-VNNI, else AVX2's byte products)."""
    return (
        bits in (4, 8)
        and n > 0
        and k > 0
        and k % 32 == 0
        and is_built()
        and torch.ops.pagedllm.quant_linear_available()
    )


def pack_quant_linear(
    q: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    per_token: bool = False,
) -> torch.Tensor:
    """The weight W[n, k] = scales[n, k // 32] * q[n, k] + mins[n, k // 32] (mins None: zero) as
    quant_linear streams it: one uint8 tensor, 4.5 bits per weight at 4 bits (5 with mins that
    are not a whole multiple of their scale, as Q4_0's -8 * d is), 8.5 at 8 bits (9 with mins),
    N padded to a multiple of 64; scales and mins stored as float16 (exact for GGUF's, which are
    float16; others rounded, 2^-11 relative at most). q: int8 [N, K], 0..15 for bits=4,
    -128..127 for bits=8; scales, mins: float32 [N, K // 32]. Deterministic; the layout is in
    csrc/quant_linear_cpu.cpp. per_token: quant_linear quantizes each activation row with one
    scale (a W8A8 checkpoint's dynamic per-token scheme) and sums over all of K in int32; it takes
    8-bit weights with one scale per column and no mins (RuntimeError otherwise)."""
    return torch.ops.pagedllm.pack_quant_linear(q, scales, mins, bits, per_token)


GGUF_PACKED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""The GGUF block formats pack_gguf_linear packs from the file's own bytes."""


def pack_gguf_linear(raw: torch.Tensor, gguf_format: str, k: int) -> torch.Tensor:
    """pack_quant_linear's blob for a GGUF tensor's rows as stored (uint8 [N, row bytes], one of
    GGUF_PACKED_FORMATS, k values a row), packed from the bytes in one pass on every core
    (csrc/gguf_pack_cpu.cpp)."""
    return torch.ops.pagedllm.pack_gguf_linear(raw, gguf_format, k)


def gguf_rows(raw: torch.Tensor, ids: torch.Tensor, gguf_format: str, k: int) -> torch.Tensor:
    """Rows `ids` of a GGUF tensor held as stored (uint8 [V, row bytes], one of
    GGUF_PACKED_FORMATS) as float32 [len(ids), k]: an embedding's lookup, the values
    BlockQuantized.dequantize gives for the same rows (csrc/gguf_pack_cpu.cpp)."""
    return _ops().gguf_rows(raw, ids, gguf_format, k)


QUANT_STREAM_AHEAD = 4096
"""quant_linear's default prefetch distance (bytes) for the weights it streams from memory."""


def quant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    n: int,
    k: int,
    bias: torch.Tensor | None,
    stream_ahead: int = QUANT_STREAM_AHEAD,
) -> torch.Tensor:
    """x @ W.T (+ bias), [M, K] float32 or bfloat16 -> [M, N] in x's dtype, from pack_quant_linear's
    weight: x's rows quantized to int8 per 32-block (as llama.cpp's Q8_0), the byte products summed
    in int32, each block's sum scaled in float32 (per token where the weight was packed so: one
    scale a row, one sum over K); each row's result is its own, whatever rows
    share the call (csrc/quant_linear_cpu.cpp). `stream_ahead`: how far ahead the weights are
    prefetched as they stream (0: left to the hardware); it changes the time, never the result."""
    return _ops().quant_linear(x, packed, bits, n, k, bias, stream_ahead)


def moe_quant_linear(
    x: torch.Tensor, packed: list[torch.Tensor], offsets: torch.Tensor, stream_ahead: int = QUANT_STREAM_AHEAD
) -> torch.Tensor:
    """A step's experts in one call: rows offsets[g] .. offsets[g + 1] of x [M, K] (grouped by
    expert) times weight g, each packed by pack_quant_linear (any bits, the same [N, K]) ->
    [M, N] in x's dtype; every row's result what quant_linear gives it. One parallel region for
    all the experts (csrc/quant_linear_cpu.cpp), where a call per expert costs a Python call and
    a region each (its start, and its threads waiting for each other at its end)."""
    return _ops().moe_quant_linear(x, packed, offsets, stream_ahead)
