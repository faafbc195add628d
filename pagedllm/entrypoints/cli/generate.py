"""`pagedllm generate "prompt"`: one completion streamed to the terminal; the flags and engine set-up
it shares with `pagedllm chat`.

Both are one-user consoles: logs stay at WARNING (on stderr) unless -v, and the KV cache gets
CONSOLE_KV_CACHE_BYTES instead of the server's 4 GiB unless a KV flag says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Generator, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.logger import configure_console_logging

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

CONSOLE_KV_CACHE_BYTES = "512MiB"
"""One user's KV cache: SmolLM2-135M's full 8,192-token context ~2.7 times over."""
_KV_FLAGS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")


def register(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", help="the prompt text")
    add_console_args(gen, default_max_tokens=128)
    add_engine_args(gen)
    gen.set_defaults(handler=run_generate)


def add_console_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    """-v and the sampling flags of `generate` and `chat`."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log INFO lines (on stderr); default: warnings only"
    )
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.seed if "seed" in args else None,
    )


def console_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine of a one-user console, with a small KV cache unless a KV flag was given."""
    from pagedllm.engine.llm_engine import LLMEngine

    configure_console_logging(args.verbose)
    overrides = {} if any(f in args for f in _KV_FLAGS) else {"kv_cache_memory_bytes": CONSOLE_KV_CACHE_BYTES}
    try:
        config = engine_config_from_args(args, disable_log_stats=True, **overrides)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    try:
        return LLMEngine(config)
    except (ValueError, OSError, NotImplementedError) as error:  # a damaged model file among them
        if args.verbose:
            raise  # the traceback, for a bug report
        raise SystemExit(f"error: {error}") from None


def reply_text(engine: LLMEngine, prompt, params: SamplingParams) -> Generator[str, None, None]:
    """One request's text, piece by piece as it grows. Closing the generator early (Ctrl-C, a
    closed pipe) aborts the request, so its KV blocks go back to the pool at once."""
    req_id = engine.add_request(None, prompt, params)
    shown = ""
    try:
        while engine.has_unfinished_requests():
            with _sigint_between_steps():
                outputs = engine.step()
            for output in outputs:
                if output.request_id == req_id:
                    text = output.outputs[0].text
                    yield text[len(shown) :]
                    shown = text
    finally:
        engine.abort_request([req_id])  # a no-op once it finished


@contextlib.contextmanager
def _sigint_between_steps() -> Iterator[None]:
    """Hold a Ctrl-C that lands inside a step and raise it after: a KeyboardInterrupt in the middle
    of `step()` would leave the scheduler half updated. A second Ctrl-C raises at once."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        yield
        return
    caught: list[int] = []

    def hold(sig: int, frame: FrameType | None) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(sig)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def run_generate(args: argparse.Namespace) -> None:
    engine = console_engine(args)
    for piece in reply_text(engine, args.prompt, sampling_params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
