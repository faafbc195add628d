"""`pagedllm` command line: one entry point, a subcommand per job.

A subcommand's module is imported only when that subcommand runs: most of them load torch, and
`pagedllm --version` or `--help` should answer at once. The other subcommands appear in the
parser as names with their help line (COMMANDS), enough to list them and to reject a typo.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from pagedllm.version import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "complete one prompt, streaming the text"),
    "chat": ("chat", "interactive chat with the model's chat template, or with a server (--url)"),
    "serve": (
        "serve",
        "OpenAI-compatible HTTP server (same flags as python -m pagedllm.entrypoints.openai.api_server)",
    ),
    "bench": ("bench", "benchmarks (throughput, prefix caching, serving)"),
    "plan": ("plan", "KV cache capacity (bytes per token, blocks, tokens, concurrency) from a config"),
    "eval": ("evaluate", "quality checks (kv-quant: 8-bit KV cache vs auto)"),
    "analyze": ("analyze", "workload analyses (prefix: where prompts stop sharing)"),
    "router": (
        "router",
        "Route OpenAI requests over several replicas, each to where its prefix is likely cached",
    ),
}
"""Subcommand -> (module under pagedllm.entrypoints.cli, its line in `pagedllm --help`). Each
module's `register(parser)` fills the parser made here with its flags."""


class StrictParser(argparse.ArgumentParser):
    """No abbreviations: `--max-num-seq` is an error, not a silent `--max-num-seqs` (nor, once a
    new flag makes it ambiguous, a different one). Subcommands inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand's real flags, or, given `argv`, only those of the
    subcommand it names (the rest as bare names)."""
    command = None if argv is None else _command_in(argv)
    parser = StrictParser(prog="pagedllm", description="LLM inference around a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_line)
        if argv is None or name == command:
            importlib.import_module(f"pagedllm.entrypoints.cli.{module}").register(subparser)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand in `argv`: its first word that is not an option (the top-level options
    take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        args.handler(args)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
