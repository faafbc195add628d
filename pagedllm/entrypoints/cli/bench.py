"""`pagedllm bench ...`: benchmarks that print ratios against a baseline run in the same process."""

from __future__ import annotations

import argparse

from pagedllm.bench import kv_quant, prefix, serve, soak, sweep, throughput


def register(bench: argparse.ArgumentParser) -> None:
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    parser = kinds.add_parser("throughput", help="engine vs Hugging Face static batching, same run")
    throughput.add_arguments(parser)
    parser.set_defaults(handler=throughput.main)
    parser = kinds.add_parser("prefix", help="prefix caching on vs off on the same traffic, same run")
    prefix.add_arguments(parser)
    parser.set_defaults(handler=prefix.main)
    parser = kinds.add_parser("kv-quant", help="8-bit KV cache vs auto: capacity, perplexity, throughput")
    kv_quant.add_arguments(parser)
    parser.set_defaults(handler=kv_quant.main)
    parser = kinds.add_parser(
        "serve",
        help="an OpenAI-compatible server (ours or vLLM's) under streamed load, with vLLM's flags and keys",
    )
    serve.add_arguments(parser)
    parser.set_defaults(handler=serve.main)
    parser = kinds.add_parser(
        "soak", help="minutes of good, aborted, disconnected and bad requests: errors, memory, leaked blocks"
    )
    soak.add_arguments(parser)
    parser.set_defaults(handler=soak.main)
    parser = kinds.add_parser(
        "sweep", help="a grid of engine settings on one workload: the best within an SLO, as a serve command"
    )
    sweep.add_arguments(parser)
    parser.set_defaults(handler=sweep.main)
