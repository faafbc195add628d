"""`pagedllm eval ...`: quality checks that compare two engine settings on a fixed data set."""

from __future__ import annotations

from pagedllm.eval import kv_quant


def register(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="quality checks (kv-quant: 8-bit KV cache vs auto)")
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)
    parser = kinds.add_parser(
        "kv-quant", help="perplexity, greedy agreement and capacity of an 8-bit KV cache against auto"
    )
    kv_quant.add_arguments(parser)
    parser.set_defaults(handler=kv_quant.main)
