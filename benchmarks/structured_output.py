"""Throughput with half the requests constrained by a grammar vs none, in one run (offline engine).

    .venv/bin/python benchmarks/structured_output.py --workload ../shared/workloads/mixed.jsonl

Both runs send the same requests, greedy, every one for exactly its max_tokens (min_tokens =
max_tokens, so EOS never ends one early and both runs compute the same tokens), prefix caching
off (the second run would find every prompt cached), twice in alternation (none, half, none,
half). In the half runs every other request is constrained: by default to a grammar that never closes (EBNF
`root ::= [ -~\\n]*`, printable ASCII), so each of its steps pays for a token mask over the whole
vocabulary, which is the cost this measures. `--schema` constrains them to a JSON schema instead,
where requests end when their JSON does; then compare tokens/s, not times.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.workload import load_workload

OPEN_GRAMMAR = "root ::= [ -~\\n]*"
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8}


def params_for(max_tokens: int, grammar: StructuredOutputsParams | None, exact: bool) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=max_tokens if exact else 0,
        ignore_eos=exact,
        structured_outputs=grammar,
    )


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="../shared/workloads/mixed.jsonl")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--schema", action="store_true", help="a JSON schema instead of the open grammar")
    parser.add_argument("--output-json")
    args = parser.parse_args()

    requests = load_workload(args.workload, args.num_requests)
    prompts = [r.prompt for r in requests]
    grammar = (
        StructuredOutputsParams(json=SCHEMA) if args.schema else StructuredOutputsParams(grammar=OPEN_GRAMMAR)
    )
    exact = not args.schema
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes="2GiB",
        max_model_len=4096,
        disable_log_stats=True,
        enable_prefix_caching=False,
    )
    free = [params_for(r.max_tokens, None, exact) for r in requests]
    half = [params_for(r.max_tokens, grammar if i % 2 else None, exact) for i, r in enumerate(requests)]
    llm.generate(prompts[:4], half[:4], use_tqdm=False)  # warm up: the vocabulary index, the grammar

    results: dict[str, dict] = {}
    for name, params in 2 * (("none constrained", free), ("half constrained", half)):
        elapsed, tokens = run(llm, prompts, params)
        entry = results.setdefault(name, {"elapsed_s": 0.0, "output_tokens": 0})
        entry["elapsed_s"] += elapsed
        entry["output_tokens"] += tokens
        entry["output_tokens_per_s"] = entry["output_tokens"] / entry["elapsed_s"]
    base, constrained = results["none constrained"], results["half constrained"]
    ratio = constrained["output_tokens_per_s"] / base["output_tokens_per_s"]
    print(f"host: {describe_host()}; dtype {args.dtype}; git {git_sha()}")
    print(
        f"{len(prompts)} requests from {args.workload}, --max-num-seqs {args.max_num_seqs}, grammar: "
        f"{'JSON schema ' + json.dumps(SCHEMA) if args.schema else OPEN_GRAMMAR}"
    )
    for name, r in results.items():
        print(
            f"  {name:17} {r['output_tokens']:6,} tokens in {r['elapsed_s']:6.1f} s = "
            f"{r['output_tokens_per_s']:6.1f} tokens/s"
        )
    print(f"half constrained / none: {ratio:.3f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"results": results, "ratio": ratio, "git": git_sha(), "host": describe_host()}, f, indent=2
            )


if __name__ == "__main__":
    main()
