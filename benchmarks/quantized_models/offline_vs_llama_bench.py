"""One stream on a GGUF file, by token ids: pagedllm offline beside llama.cpp's `llama-bench`, in turn.

    .venv/bin/python benchmarks/quantized_models/offline_vs_llama_bench.py \
        --llama-bench $LLAMA_CPP_BUILD/bin/llama-bench --rounds 2 FILE.gguf [FILE.gguf ...]

Where a served comparison cannot be fair, this one is: both engines get token ids, so neither
tokenizer is involved (a file written by write_gguf.py in a shape whose architecture has its own
tokenizer class, Gemma 3's, carries SmolLM2's BPE vocabulary, which llama.cpp reads as it is and
transformers would convert as Gemma's). Per round and file, llama-bench runs pp512, and tg64 after
512 tokens (`-d 512`), with the same threads (`-t`, one repetition each); pagedllm (`LLM`, one
request at a time, prefix caching off) computes a 512-token prompt of random ids and decodes 64
greedy tokens, EOS ignored: prompt tokens/s = 512 / time to first token, decode tokens/s = 63 /
the time from the first token to the last (so both decode against the prompt's 512 keys). Rounds
alternate the two engines so a host's drift hits both. Prints each round and the ratios of the
medians (pagedllm / llama.cpp); --out writes them as JSON. --apart: for a file the host can hold
once but not twice (llama.cpp repacks Q4_0 into memory of its own beside its mapping), pagedllm
loads the file again each round and lets it go before llama-bench runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
from pathlib import Path

PROMPT_TOKENS = 512
OUTPUT_TOKENS = 64


def llama_bench(binary: Path, model: Path, threads: int) -> dict[str, float]:
    """llama-bench's pp512 and tg64 tokens/s (one repetition each), tg64 at a depth of 512 tokens
    already in its cache, as pagedllm decodes after the prompt (llama-bench's own tg64 starts
    from an empty cache: no attention to speak of)."""
    base = [str(binary), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json"]
    rates = {}
    for key, flags in (
        ("prompt_tok_s", ["-p", str(PROMPT_TOKENS), "-n", "0"]),
        ("decode_tok_s", ["-p", "0", "-n", str(OUTPUT_TOKENS), "-d", str(PROMPT_TOKENS)]),
    ):
        out = subprocess.run([*base, *flags], check=True, capture_output=True, text=True).stdout
        (row,) = json.loads(out)
        rates[key] = row["avg_ts"]
    return rates


def pagedllm_offline(llm, seed: int) -> dict[str, float]:
    """One request: 512 random token ids in, 64 greedy tokens out."""
    from pagedllm import SamplingParams

    rng = random.Random(seed)
    ids = [rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    metrics = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].metrics
    ttft = metrics.first_token_time - metrics.arrival_time
    decode = metrics.last_token_time - metrics.first_token_time
    return {"prompt_tok_s": PROMPT_TOKENS / ttft, "decode_tok_s": (OUTPUT_TOKENS - 1) / decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-bench", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="pagedllm's --dtype (default auto)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--apart", action="store_true", help="pagedllm loads the file each round, freed before llama-bench"
    )
    args = parser.parse_args()

    from pagedllm import LLM

    def load(path: Path):
        llm = LLM(
            str(path),
            dtype=args.dtype,
            max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + 16,
            max_num_seqs=1,
            enable_prefix_caching=False,
            kv_cache_memory_bytes="1GiB",
            disable_log_stats=True,
        )
        pagedllm_offline(llm, seed=-1)  # warm-up: the first request times the kernels' choices
        return llm

    results = {}
    for path in args.files:
        llm = None if args.apart else load(path)
        rounds: dict[str, list[dict[str, float]]] = {"pagedllm": [], "llama.cpp": []}
        for r in range(args.rounds):
            first, second = ("pagedllm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "pagedllm")
            for engine in (first, second):
                if engine == "pagedllm":
                    ours = llm if llm is not None else load(path)
                    run = pagedllm_offline(ours, r)
                    if args.apart:
                        ours.llm_engine.close()
                        del ours
                        gc.collect()
                else:
                    run = llama_bench(args.llama_bench, path, args.threads)
                rounds[engine].append(run)
                print(f"{path.name} round {r + 1} {engine:9s} prompt {run['prompt_tok_s']:7.1f} tok/s  "
                      f"decode {run['decode_tok_s']:6.1f} tok/s", flush=True)  # fmt: skip
        medians = {
            engine: {
                key: statistics.median(run[key] for run in runs) for key in ("prompt_tok_s", "decode_tok_s")
            }
            for engine, runs in rounds.items()
        }
        ratios = {key: medians["pagedllm"][key] / medians["llama.cpp"][key] for key in medians["pagedllm"]}
        prompt, decode = ratios["prompt_tok_s"], ratios["decode_tok_s"]
        print(f"{path.name}: pagedllm / llama.cpp  prompt {prompt:.2f}x  decode {decode:.2f}x")
        results[path.name] = {"rounds": rounds, "medians": medians, "ratios": ratios}
        del llm
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
