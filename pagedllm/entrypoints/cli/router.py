"""`pagedllm router --replica URL ...`: one OpenAI endpoint over several `pagedllm serve` replicas."""

from __future__ import annotations

import argparse
import functools
import logging

import uvicorn
from fastapi import FastAPI

from pagedllm import limits
from pagedllm.entrypoints.openai.listen_socket import bind_socket
from pagedllm.entrypoints.router.app import build_app
from pagedllm.entrypoints.router.policy import POLICIES, CacheAware, make_policy
from pagedllm.entrypoints.router.replicas import ReplicaSet
from pagedllm.logger import configure_logging

logger = logging.getLogger(__name__)

CHUNK_CHARS = 64  # about a 16-token KV block of English text


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and an aggregated "
        "/metrics, /stats and /dashboard in front of `pagedllm serve` replicas. See docs/scaling.md."
    )
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="A replica's base URL, e.g. http://10.0.0.2:8000; repeat for each replica.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on. (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on. (default: %(default)s)")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware", help="(default: %(default)s)")
    parser.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: follow a replica's cached prefix when it covers at least this share of the "
        "prompt. (default: %(default)s)",
    )
    parser.add_argument(
        "--min-match-chars",
        type=int,
        default=2048,
        help="cache_aware: ... or at least this many characters of it. (default: %(default)s)",
    )
    parser.add_argument(
        "--balance-threshold",
        type=int,
        default=8,
        help="cache_aware: give up affinity when the chosen replica has more than this many requests in "
        "flight above the least loaded one ... (default: %(default)s)",
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="cache_aware: ... and more than this many times as many. (default: %(default)s)",
    )
    parser.add_argument(
        "--max-index-chars",
        type=int,
        default=4 * 1024 * 1024,
        help="cache_aware: prompt characters remembered per replica (LRU). (default: %(default)s)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        help="Seconds between /health probes. (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="Seconds a replica may take to answer a request. (default: %(default)s)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Refuse a larger request body with a 413 before reading the rest of it, as a replica "
        "does. (default: %(default)s)",
    )
    parser.set_defaults(handler=functools.partial(_router, parser))


def build_router(args: argparse.Namespace) -> FastAPI:
    """The router app for parsed flags (ValueError on bad values)."""
    cache_aware = CacheAware(
        cache_threshold=args.cache_threshold,
        min_match_chars=args.min_match_chars,
        balance_abs_threshold=args.balance_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
    )
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    policy = make_policy(args.policy, cache_aware)
    replica_set = ReplicaSet(
        args.replica,
        policy,
        health_interval=args.health_interval,
        chunk_chars=CHUNK_CHARS,
        max_index_chunks=max(1, args.max_index_chars // CHUNK_CHARS),
    )
    return build_app(
        replica_set, request_timeout=args.request_timeout, max_request_body_bytes=args.max_request_body_bytes
    )


def _router(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    configure_logging()
    try:
        app = build_router(args)
    except ValueError as error:
        parser.error(str(error))
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    logger.info(
        "Routing the OpenAI API on http://%s:%d over %s (%s)",
        host,
        port,
        ", ".join(args.replica),
        args.policy,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
