"""`pagedllm eval ...`: quality checks that compare two engine settings on a fixed data set."""

from __future__ import annotations

import argparse

from pagedllm.eval import kv_quant, weight_quant


def register(evaluate: argparse.ArgumentParser) -> None:
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)
    parser = kinds.add_parser(
        "kv-quant", help="perplexity, greedy agreement and capacity of an 8-bit KV cache against auto"
    )
    kv_quant.add_arguments(parser)
    parser.set_defaults(handler=kv_quant.main)
    parser = kinds.add_parser(
        "weight-quant",
        help="perplexity, greedy agreement and bytes of quantized weights (a GGUF's own, int8, int4) "
        "against the same weights dequantized",
    )
    weight_quant.add_arguments(parser)
    parser.set_defaults(handler=weight_quant.main)
