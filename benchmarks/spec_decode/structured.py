"""Speculation under a JSON schema: structured output off vs ngram on, offline, in one run.

    .venv/bin/python benchmarks/spec_decode/structured.py [--concurrency 1 4] [--repeats 2]

Two workloads of constrained requests (greedy, the default model, `--dtype auto`):
- extract: a short order message in the prompt, the fields of it as JSON out (the output quotes
  the prompt: n-gram drafts, and the schema's keys forced by the grammar);
- invent: an order made up from a one-line request, nothing to quote (drafts come from the keys the
  grammar forces, and from what the output repeats of itself).
Each concurrency runs off, on, off, on on the same requests; tokens/s are output tokens over the
wall time of the generate calls, summed per setting. The greedy outputs off and on must be the
same tokens: the script checks it and says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline import alternate, close  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.cpu_features import describe_host  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

ORDER = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 40},
        "street_address": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "product_description": {"type": "string", "maxLength": 60},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
        "delivery_day": {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]},
        "gift_wrapping_requested": {"type": "boolean"},
    },
    "required": [
        "customer_name",
        "street_address",
        "city",
        "product_description",
        "quantity",
        "delivery_day",
        "gift_wrapping_requested",
    ],
    "additionalProperties": False,
}
NAMES = ["Maria Lopez", "James Okafor", "Li Wei", "Anna Schmidt", "Tomas Novak", "Priya Raman", "Sam Carter"]
STREETS = ["14 Elm Street", "221 Harbour Road", "7 Mill Lane", "98 Station Avenue", "3 Orchard Close"]
CITIES = ["Springfield", "Riverton", "Lakeside", "Fairview", "Greenville"]
PRODUCTS = ["oak garden chairs", "blue ceramic planters", "folding picnic tables", "solar lanterns"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def extract_prompts(n: int) -> list[str]:
    prompts = []
    for i in range(n):
        message = (
            f"Hello, this is {NAMES[i % len(NAMES)]} from {STREETS[i % len(STREETS)]}, "
            f"{CITIES[i % len(CITIES)]}. I would like {2 + i % 9} {PRODUCTS[i % len(PRODUCTS)]} "
            f"delivered on {DAYS[i % len(DAYS)]}, {'with' if i % 2 else 'without'} gift wrapping."
        )
        prompts.append(f"Customer message: {message}\nThe order in that message, as JSON: ")
    return prompts


def invent_prompts(n: int) -> list[str]:
    return [
        f"Write a plausible order for {PRODUCTS[i % len(PRODUCTS)]} by a customer in "
        f"{CITIES[i % len(CITIES)]}, as JSON: "
        for i in range(n)
    ]


WORKLOADS = {"extract": extract_prompts, "invent": invent_prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    print(f"host: {describe_host()}; git {git.stdout.strip()}; dtype auto; ngram {NGRAM}")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=json.dumps(ORDER)),
    )
    print(
        "| workload | in flight | requests | off tok/s | ngram tok/s | ngram / off | accepted | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        settings = {"max_num_seqs": c, "kv_cache_memory_bytes": "2GiB", "disable_log_stats": True}
        engines = {"off": LLM(**settings), "on": LLM(**settings, speculative_config=NGRAM)}
        for workload, make_prompts in WORKLOADS.items():
            prompts = make_prompts(max(4, 2 * c))
            rates, rounds = alternate(
                engines,
                lambda llm, prompts=prompts: llm.generate(prompts, params, use_tqdm=False),
                args.repeats,
            )
            drafted = sum(o.draft_tokens[0] for r in rounds for o in r["on"] if o.draft_tokens)
            accepted = sum(o.draft_tokens[1] for r in rounds for o in r["on"] if o.draft_tokens)
            same = all(
                a.outputs[0].token_ids == b.outputs[0].token_ids
                for a, b in zip(rounds[-1]["off"], rounds[-1]["on"], strict=True)
            )
            print(
                f"| {workload} | {c} | {len(prompts)} | {rates['off']:.1f} | {rates['on']:.1f} | "
                f"**{rates['on'] / rates['off']:.2f}** | {accepted / max(1, drafted):.2f} "
                f"({accepted:,} of {drafted:,}) | {'yes' if same else 'NO'} |",
                flush=True,
            )
        close(engines)


if __name__ == "__main__":
    main()
