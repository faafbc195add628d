"""`pagedllm` command line: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.cli import bench, evaluate, generate, plan, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference around a paged KV cache")
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate.register(subparsers)
    serve.register(subparsers)
    bench.register(subparsers)
    plan.register(subparsers)
    evaluate.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
