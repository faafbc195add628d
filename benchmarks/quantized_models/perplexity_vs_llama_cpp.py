"""Perplexity of GGUF files in pagedllm against llama.cpp's `llama-perplexity`, side by side.

    .venv/bin/python benchmarks/quantized_models/perplexity_vs_llama_cpp.py \
        --llama-perplexity llama.cpp-build/bin/llama-perplexity [--ctx 256] FILE.gguf [FILE.gguf ...]

The text is pagedllm's eval set (pagedllm/eval/data/texts.json, joined by blank lines), written to
OUT/texts.txt, or --text-file. For each file, llama.cpp runs `llama-perplexity -f TEXT -c CTX
-b CTX -t THREADS --kl-divergence-base OUT/FILE.llama.kld`: its perplexity, and its
log-probabilities of every scored position with the tokens it read (the base file of its
`--kl-divergence` mode). Then pagedllm scores the same tokens the way perplexity.cpp does:

    tokens   t_0 t_1 ... of the text; with the GGUF's add_bos_token, t_0 of each chunk is replaced by BOS
    chunk c  tokens [c*CTX, (c+1)*CTX), c < len(tokens) // CTX, each from an empty KV cache
    scored   the second half: logits at positions CTX/2 .. CTX-2 predicting tokens CTX/2+1 .. CTX-1
    PPL      exp(mean negative log-likelihood over all chunks' scored tokens)

through the engine's own prompt scoring (`prompt_logprobs=0`, one chunk per request, as
pagedllm/eval/scoring.py does), in three runs: the file's blocks kept quantized (the default) at
`--dtype auto` and at float32, and every weight dequantized to float32 (`--quantization none`, the
reference). The logits of the scored positions (the ones the runner's prompt scoring computes,
recorded as they pass) also give, against llama.cpp's base file, llama.cpp's KL divergence
KL(llama.cpp || pagedllm) (its formula: base probabilities below e^-16 left out) and how often the
two pick the same top token. Both score the token ids llama.cpp read (the comparison is of the
forward passes); pagedllm's own tokenization of the text is checked against them, and where it
differs the first difference is reported. PPL ratios to llama.cpp are paired (the same tokens):
exp(mean difference of the tokens' negative log-likelihoods) +- its standard error.
`--write-base` also writes each pagedllm run's log-probabilities in llama.cpp's base format.

With `--reference REF.gguf` (the same weights in F32, say), llama.cpp scores REF once, and every run
on every file, llama.cpp's too (its own `--kl-divergence` mode), gets its KL divergence from REF
and its share of top tokens equal to REF's: how far each engine's arithmetic on a file strays from
the exact model. Printed: a markdown table, one row per engine run; everything to OUT/results.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "vllm_compare"))
from run import host_info  # noqa: E402

from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.eval.scoring import load_eval_set, run_generation  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

# label -> (--quantization, --dtype): the file as served, as served in float32, the reference
RUNS = {
    "quantized": (None, "auto"),
    "quantized-f32": (None, "float32"),
    "dequantized-f32": ("none", "float32"),
}
GGUF_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 15: "Q4_K_M", 18: "Q6_K", 32: "BF16"}


@dataclass
class LlamaBase:
    """llama-perplexity's run: its PPL and the base file it wrote (perplexity.cpp's format)."""

    ppl: float
    ppl_error: float
    n_ctx: int
    tokens: np.ndarray  # [n_chunk, n_ctx] int32
    scale: np.ndarray  # [n_chunk, n_scored] float32: log p = scale * q + min_log_prob
    min_log_prob: np.ndarray  # [n_chunk, n_scored] float32
    q: np.ndarray  # [n_chunk, n_scored, n_vocab] uint16

    def log_probs(self, chunk: int) -> np.ndarray:
        """[n_scored, n_vocab] float32, as perplexity.cpp reads them back."""
        return (
            self.scale[chunk][:, None] * self.q[chunk].astype(np.float32) + self.min_log_prob[chunk][:, None]
        )

    def nll(self) -> np.ndarray:
        """[n_chunk * n_scored]: each scored token's negative log-likelihood."""
        first = self.n_ctx // 2
        targets = self.tokens[:, first + 1 :]  # [n_chunk, n_scored]
        q = np.take_along_axis(self.q, targets[..., None].astype(np.int64), axis=-1)[..., 0]
        return -(self.scale * q + self.min_log_prob).reshape(-1)


@dataclass
class Agreement:
    """perplexity.cpp's KL(base || other) statistics over the scored positions."""

    kld_mean: float
    kld_max: float | None
    same_top: float


@dataclass
class EngineRun:
    engine: str
    weights: str
    ppl: float
    num_scored: int
    agreement: dict[str, Agreement] = field(default_factory=dict)  # "llama.cpp" / "reference"
    ppl_from_logits: float | None = None
    seconds: float | None = None
    tokens_differ: str | None = None  # where pagedllm's tokenization parts from llama.cpp's


def run_llama(binary: str, gguf: Path, text_file: Path, n_ctx: int, threads: int, out: Path) -> LlamaBase:
    base_file = out / f"{gguf.stem}.llama.kld"
    log = out / f"{gguf.stem}.llama.log"
    run_logged([binary, "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx),
                "-t", str(threads), "--kl-divergence-base", str(base_file)], log)  # fmt: skip
    found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log.read_text())
    if found is None:
        raise RuntimeError(f"no 'Final estimate' in {log}")
    return read_base(base_file, float(found[1]), float(found[2]))


def llama_agreement(binary: str, gguf: Path, ref: Path, n_ctx: int, threads: int, out: Path) -> Agreement:
    """llama.cpp's own --kl-divergence of gguf against the reference's base file."""
    log, ref_file = out / f"{gguf.stem}.llama-vs-reference.log", out / f"{ref.stem}.llama.kld"
    run_logged([binary, "-m", str(gguf), "-c", str(n_ctx), "-b", str(n_ctx), "-t", str(threads),
                "--kl-divergence-base", str(ref_file), "--kl-divergence"], log)  # fmt: skip
    text = log.read_text()
    kld, top = re.search(r"Mean +KLD: +(-?[\d.]+)", text), re.search(r"Same top p: +([\d.]+)", text)
    maximum = re.search(r"Maximum KLD: +([\d.]+)", text)
    if kld is None or top is None:
        raise RuntimeError(f"no KLD statistics in {log}")
    return Agreement(float(kld[1]), float(maximum[1]) if maximum else None, float(top[1]) / 100)


def run_logged(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)


def read_base(path: Path, ppl: float, ppl_error: float) -> LlamaBase:
    """perplexity.cpp's --kl-divergence-base file: "_logits_", n_ctx, n_vocab, n_chunk (int32),
    the tokens [n_chunk * n_ctx] (int32), then per chunk and scored position (n_ctx - 1 - n_ctx/2
    of them) nv = 2*((n_vocab+1)/2) + 4 uint16: two float32 (scale, min_log_prob), then
    n_vocab log-probabilities quantized to 16 bits above max - 16."""
    data = path.read_bytes()
    if data[:8] != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity base file")
    n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(data, np.int32, 3, 8))
    offset = 20 + 4 * n_chunk * n_ctx
    tokens = np.frombuffer(data, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv, n_scored = 2 * ((n_vocab + 1) // 2) + 4, n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(data, np.uint16, n_chunk * n_scored * nv, offset).reshape(n_chunk, n_scored, nv)
    head = np.ascontiguousarray(rows[:, :, :4]).view(np.float32)  # [n_chunk, n_scored, 2]
    return LlamaBase(ppl, ppl_error, n_ctx, tokens, head[..., 0], head[..., 1], rows[:, :, 4 : 4 + n_vocab])


def encode_base(logits: torch.Tensor) -> np.ndarray:
    """perplexity.cpp's log_softmax() for the base file: logits [n_scored, n_vocab] -> uint16
    rows [n_scored, nv] (scale and min_log_prob as two float32, then the 16-bit codes)."""
    x = logits.float().numpy()
    n_scored, n_vocab = x.shape
    max_logit = x.max(axis=-1, keepdims=True)
    min_logit = np.maximum(x.min(axis=-1, keepdims=True), max_logit - 16)
    log_sum_exp = np.log(np.exp(x - max_logit).sum(axis=-1, keepdims=True, dtype=np.float64))
    scale = (max_logit - min_logit) / np.float32(65535)
    head = np.concatenate([scale, (min_logit - max_logit - log_sum_exp).astype(np.float32)], axis=-1)
    codes = np.where(x > min_logit, np.rint((x - min_logit) / np.where(scale > 0, scale, 1)), 0)
    rows = np.zeros((n_scored, 2 * ((n_vocab + 1) // 2) + 4), np.uint16)
    rows[:, :4] = np.ascontiguousarray(head, np.float32).view(np.uint16)
    rows[:, 4 : 4 + n_vocab] = codes
    return rows


def write_base(path: Path, tokens: np.ndarray, rows: list[np.ndarray]) -> None:
    """A base file llama.cpp's `--kl-divergence` reads (read_base's format)."""
    n_chunk, n_ctx = tokens.shape
    n_vocab = 2 * ((rows[0].shape[1] - 4) // 2)  # SmolLM2's and Llama's vocabularies are even
    with path.open("wb") as f:
        f.write(b"_logits_" + np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes())
        f.write(np.ascontiguousarray(tokens, np.int32).tobytes())
        for chunk_rows in rows:
            f.write(chunk_rows.tobytes())


def kl_divergence(log_base: np.ndarray, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """perplexity.cpp's KL(base || ours) per scored position (base probabilities below e^-16 left
    out), and whether the top tokens agree. log_base, logits: [n_scored, n_vocab]."""
    log_ours = torch.log_softmax(logits.double(), dim=-1).numpy()
    terms = np.where(log_base > -16.0, np.exp(log_base) * (log_base - log_ours), 0.0)
    return terms.sum(axis=-1), log_base.argmax(axis=-1) == log_ours.argmax(axis=-1)


def run_pagedllm(
    gguf: Path,
    label: str,
    text: str,
    bases: dict[str, LlamaBase],
    threads: int,
    bos_id: int | None,
    base_out: Path | None = None,
) -> tuple[EngineRun, np.ndarray]:
    """pagedllm scores llama.cpp's chunks; returns the run and its per-token NLL [n_chunk * n_scored].
    base_out: where to write pagedllm's log-probabilities as a llama.cpp base file."""
    started = time.perf_counter()
    quantization, dtype = RUNS[label]
    base = bases["llama.cpp"]
    n_ctx, first = base.n_ctx, base.n_ctx // 2
    config = EngineConfig(
        model=str(gguf), quantization=quantization, dtype=dtype, max_model_len=n_ctx + 16,
        max_num_seqs=1, max_num_batched_tokens=max(2048, n_ctx), kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False, num_threads=threads, disable_log_stats=True,
    )  # fmt: skip
    engine = LLMEngine(config)
    try:
        chunks, differ = compare_tokens(engine.tokenizer(text).input_ids, bases)
        n_chunk = chunks.shape[0]
        model = engine.core.worker.runner.model
        compute_logits, recorded = model.compute_logits, []

        def recording(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            recorded.append(logits.float().cpu())
            return logits

        model.compute_logits = recording  # every logits row the runner computes, in position order
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        nll, nll_logits = [], []
        found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in bases}
        encoded: list[np.ndarray] = []
        for c in range(n_chunk):
            recorded.clear()
            chunk = chunks[c].tolist()
            prompt = chunk if bos_id is None else [bos_id, *chunk[1:]]  # as perplexity.cpp does
            (output,) = run_generation(engine, [{"prompt_token_ids": prompt}], params)
            positions = output.prompt_logprobs or []  # [None, then token i's logprob given 0..i-1]
            nll += [-positions[i][chunk[i]].logprob for i in range(first + 1, n_ctx)]
            logits = torch.cat(recorded)[first : n_ctx - 1]  # [n_scored, vocab]; rows 0..n_ctx-1 recorded
            targets = torch.tensor(chunk[first + 1 :])
            log_probs = torch.log_softmax(logits.double(), -1)
            nll_logits += (-log_probs[torch.arange(len(targets)), targets]).tolist()
            for name, other in bases.items():
                found[name].append(kl_divergence(other.log_probs(c), logits))
            if base_out is not None:
                encoded.append(encode_base(logits))
        model.compute_logits = compute_logits
        if base_out is not None:
            write_base(base_out, chunks, encoded)
    finally:
        engine.close()
    agreement = {}
    for name, pairs in found.items():
        kld, top = (np.concatenate(x) for x in zip(*pairs, strict=True))
        agreement[name] = Agreement(float(kld.mean()), float(kld.max()), float(top.mean()))
    run = EngineRun(
        engine="pagedllm",
        weights=label,
        ppl=math.exp(sum(nll) / len(nll)),
        num_scored=len(nll),
        agreement=agreement,
        ppl_from_logits=math.exp(sum(nll_logits) / len(nll_logits)),
        seconds=time.perf_counter() - started,
        tokens_differ=differ,
    )
    return run, np.array(nll)


def compare_tokens(tokens: list[int], bases: dict[str, LlamaBase]) -> tuple[np.ndarray, str | None]:
    """The chunks to score: llama.cpp's tokens, [n_chunk, n_ctx]; and where pagedllm's own
    tokenization of the text parts from them (None: it does not)."""
    theirs = bases["llama.cpp"].tokens
    for name, other in bases.items():
        if other.tokens.shape != theirs.shape or (other.tokens != theirs).any():
            raise RuntimeError(f"the {name} run read other tokens than llama.cpp's run of this file")
    flat, ours = theirs.reshape(-1), np.array(tokens, np.int32)
    agree = min(len(ours), flat.size)
    mismatch = np.flatnonzero(ours[:agree] != flat[:agree])
    if mismatch.size == 0 and len(ours) // theirs.shape[1] == theirs.shape[0]:
        return theirs, None
    at = int(mismatch[0]) if mismatch.size else agree
    differ = (
        f"pagedllm tokenizes the text to {len(ours)} tokens; the first of llama.cpp's "
        f"{flat.size} scored ones that differs is #{at} (llama.cpp {flat[at : at + 4].tolist()}, "
        f"pagedllm {ours[at : at + 4].tolist()}); llama.cpp's tokens are scored"
    )
    print(differ, file=sys.stderr)
    return theirs, differ


def paired_ratio(nll: np.ndarray, nll_base: np.ndarray) -> tuple[float, float]:
    """PPL / PPL(base) on the same tokens, and its standard error."""
    diff = nll - nll_base
    ratio = math.exp(diff.mean())
    return ratio, ratio * diff.std(ddof=1) / math.sqrt(len(diff))


def gguf_metadata(path: Path) -> tuple[str, int | None]:
    """(the file's format, the BOS id perplexity.cpp writes over each chunk's first token or None)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    file_type, add_bos = fields.get("general.file_type"), fields.get("tokenizer.ggml.add_bos_token")
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    fmt = GGUF_TYPES.get(int(file_type.contents()), "?") if file_type else "?"
    return fmt, int(bos_id.contents()) if add_bos and add_bos.contents() and bos_id else None


def table_row(gguf: Path, fmt: str, run: EngineRun, ratio: tuple[float, float] | None) -> str:
    cells = [gguf.name, fmt, run.engine, run.weights, f"{run.ppl:.4f}"]
    cells.append(f"{ratio[0]:.4f} ± {ratio[1]:.4f}" if ratio else "1")
    for name in ("llama.cpp", "reference"):
        a = run.agreement.get(name)
        cells += [f"{a.kld_mean:.5f}", f"{a.same_top:.1%}"] if a else ["", ""]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-perplexity", required=True, help="llama.cpp's llama-perplexity binary")
    parser.add_argument("--reference", type=Path, help="the same weights unquantized (F32 or F16 GGUF)")
    parser.add_argument(
        "--text-file", type=Path, help="score this UTF-8 text instead of pagedllm's eval set (more tokens)"
    )
    parser.add_argument("--ctx", type=int, default=256, help="tokens per chunk (llama-perplexity -c)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="both engines' threads")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="pagedllm's runs")
    parser.add_argument(
        "--write-base",
        action="store_true",
        help="also write each pagedllm run's log-probabilities as OUT/FILE.pagedllm-RUN.kld, a base file "
        "for `llama-perplexity -m FILE --kl-divergence-base THAT --kl-divergence`",
    )
    parser.add_argument("--out", type=Path, default=REPO / "results/perplexity_vs_llama_cpp")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.text_file:
        text_file, text = args.text_file, args.text_file.read_text(encoding="utf-8")
    else:
        text, text_file = "\n\n".join(load_eval_set("texts")), args.out / "texts.txt"
        text_file.write_text(text, encoding="utf-8")
    common = (args.ctx, args.threads, args.out)  # every llama-perplexity run's -c, -t and log folder
    reference = (
        run_llama(args.llama_perplexity, args.reference, text_file, *common) if args.reference else None
    )
    results: dict = {
        "host": host_info(),
        "text": str(text_file),
        "ctx": args.ctx,
        "threads": args.threads,
        "files": [],
    }
    print(
        "| file | format | engine | weights | PPL | PPL / llama.cpp's (paired) | KLD from llama.cpp "
        "| same top | KLD from reference | same top |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gguf in args.files:
        fmt, bos_id = gguf_metadata(gguf)
        base = run_llama(args.llama_perplexity, gguf, text_file, *common)
        bases = {"llama.cpp": base} | ({"reference": reference} if reference else {})
        theirs = EngineRun("llama.cpp", "as stored", base.ppl, base.nll().size)
        if reference:
            theirs.agreement["reference"] = llama_agreement(
                args.llama_perplexity, gguf, args.reference, *common
            )
        print(table_row(gguf, fmt, theirs, None), flush=True)
        runs = [theirs]
        for label in args.runs:
            gc.collect()  # one engine's weights at a time
            base_out = args.out / f"{gguf.stem}.pagedllm-{label}.kld" if args.write_base else None
            run, nll = run_pagedllm(gguf, label, text, bases, args.threads, bos_id, base_out)
            runs.append(run)
            print(table_row(gguf, fmt, run, paired_ratio(nll, base.nll())), flush=True)
        results["files"].append({"file": str(gguf), "format": fmt, "runs": [asdict(r) for r in runs]})
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
