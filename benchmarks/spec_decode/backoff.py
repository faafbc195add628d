"""Speculation where it mostly fails: the chat workload sampled at temperature 1 (the drafts are
mostly rejected), off vs ngram on, offline, at 1, 4 and 16 in flight, in one run.

    .venv/bin/python benchmarks/spec_decode/backoff.py [--concurrency 1 4 16] [--temperature 1.0]

The served benchmark (run.py) is greedy, where SmolLM2-135M repeats itself and accepts most
drafts; this is the case the back-off is for (a draft row's measured cost against a request's
acceptance, docs/architecture.md): the target is that speculation costs nothing here (>= 0.97x).
Each concurrency runs off, on, off, on (the same requests, unseeded sampling); tokens/s are output
tokens over the wall time of the generate calls, summed per setting.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline import alternate, close  # noqa: E402
from workloads import chat_requests  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.cpu_features import describe_host  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    print(f"host: {describe_host()}; git {git.stdout.strip()}; dtype auto")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"chat workload, temperature {args.temperature}, {args.max_tokens} tokens, ngram {NGRAM}")
    print("| in flight | requests | off tok/s | ngram tok/s | ngram / off | accepted | mean acc. len |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        settings = {"max_num_seqs": c, "kv_cache_memory_bytes": "2GiB", "disable_log_stats": True}
        engines = {"off": LLM(**settings), "on": LLM(**settings, speculative_config=NGRAM)}
        conversations = [[{"role": "user", "content": r.turns[0]}] for r in chat_requests(max(4, 2 * c))]
        rates, _ = alternate(
            engines, lambda llm, chats=conversations: llm.chat(chats, params, use_tqdm=False), args.repeats
        )
        spec = engines["on"].llm_engine.get_stats().spec_decode
        assert spec is not None
        print(
            f"| {c} | {len(conversations)} | {rates['off']:.1f} | {rates['on']:.1f} | "
            f"**{rates['on'] / rates['off']:.2f}** | {spec.acceptance_rate:.2f} | "
            f"{spec.mean_acceptance_length:.2f} |",
            flush=True,
        )
        close(engines)


if __name__ == "__main__":
    main()
