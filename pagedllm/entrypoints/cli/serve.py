"""`pagedllm serve [MODEL]`: the OpenAI-compatible server, with the api_server module's own flags
(server_config.py)."""

from __future__ import annotations

import argparse
import functools

from pagedllm.entrypoints.openai.server_config import (
    add_server_args,
    check_server_args,
    start_rank_forkserver,
)


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /version, /tokenize, /detokenize, /metrics, /stats and /dashboard."
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model folder, GGUF file or hub name ORG/NAME (same as --model). "
        "Default: the embedded SmolLM2-135M-Instruct.",
    )
    add_server_args(parser)
    parser.set_defaults(handler=functools.partial(_serve, parser))


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if getattr(args, "model", args.model_tag) != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    del args.model_tag
    check_server_args(parser, args)
    start_rank_forkserver(args)
    # Imported here, not above: it loads torch and the engine (~4 s), which `serve --help` and a
    # flag refused by the parser or check_server_args should not wait for.
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)
