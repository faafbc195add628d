"""`pagedllm generate "prompt"` and `pagedllm chat`: text streamed to the terminal."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import sys
from pathlib import Path
from typing import Any

from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.logger import configure_logging
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import chat_prompt


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="complete one prompt, streaming the text")
    gen.add_argument("prompt", help="the prompt text")
    _add_sampling_args(gen, default_max_tokens=128)
    add_engine_args(gen)
    gen.set_defaults(handler=run_generate)

    chat = subparsers.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    _add_sampling_args(chat, default_max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(handler=run_chat)


def _add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
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


def _engine(args: argparse.Namespace) -> LLMEngine:
    configure_logging()
    return LLMEngine(engine_config_from_args(args, disable_log_stats=True))


def stream(engine: LLMEngine, prompt, params: SamplingParams, out=sys.stdout) -> str:
    """Run one request, writing its text as it grows. Returns the whole text."""
    req_id = engine.add_request(None, prompt, params)
    shown = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != req_id:
                continue
            text = output.outputs[0].text
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    out.write("\n")
    return shown


def run_generate(args: argparse.Namespace) -> None:
    engine = _engine(args)
    stream(engine, args.prompt, _sampling_params(args))


def run_chat(args: argparse.Namespace) -> None:
    engine = _engine(args)
    params = _sampling_params(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    _line_editing()
    print("Chat with the model. /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = chat_prompt(engine.tokenizer, messages)
        try:
            answer = stream(engine, prompt, params)
        except ValueError as error:  # e.g. the history outgrew max_model_len
            print(f"error: {error}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})


HISTORY_FILE = Path.home() / ".pagedllm_chat_history"


def _line_editing() -> None:
    """Arrow keys, editing and a history kept across sessions for input(), where readline exists."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(HISTORY_FILE)
    readline.set_history_length(1000)
    atexit.register(_save_history, readline)


def _save_history(readline: Any) -> None:
    with contextlib.suppress(OSError):
        readline.write_history_file(HISTORY_FILE)
