"""`pagedllm` command line: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedllm import __version__
from pagedllm.entrypoints.cli import analyze, bench, evaluate, generate, plan, router, serve


class StrictParser(argparse.ArgumentParser):
    """No abbreviations: `--max-num-seq` is an error, not a silent `--max-num-seqs` (nor, once a
    new flag makes it ambiguous, a different one). Subcommands inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="pagedllm", description="LLM inference around a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate.register(subparsers)
    serve.register(subparsers)
    bench.register(subparsers)
    plan.register(subparsers)
    evaluate.register(subparsers)
    analyze.register(subparsers)
    router.register(subparsers)
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
