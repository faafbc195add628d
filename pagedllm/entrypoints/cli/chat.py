"""`pagedllm chat`: a prompt loop with the model loaded here, or with a running OpenAI-compatible
server (`--url`, as `vllm chat --url`).

Keys as in llama.cpp and Ollama: Ctrl-C during a reply stops that reply (its request is aborted,
its KV blocks freed) and returns to the prompt, the cut reply kept in the history; Ctrl-C at the
prompt, Ctrl-D or /exit quits. The model's text goes to stdout, everything else to stderr.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, TextIO

import httpx

from pagedllm.config import add_engine_args
from pagedllm.entrypoints.cli.generate import add_console_args, console_engine, reply_text, sampling_params

Reply = Callable[[list[dict]], Generator[str, None, None]]
"""The conversation so far -> the assistant's next message in pieces; closing the iterator early
stops the reply."""

HISTORY_FILE = Path.home() / ".pagedllm_chat_history"


class ReplyError(Exception):
    """No reply: the server refused the request or could not be reached."""


def register(chat: argparse.ArgumentParser) -> None:
    chat.description = (
        "Chat in the terminal. /reset clears the history; Ctrl-C stops a reply; "
        "Ctrl-D, /exit or Ctrl-C at the prompt quits."
    )
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument(
        "--url",
        default=None,
        help="chat with a running OpenAI-compatible server at this URL (e.g. http://localhost:8000) "
        "instead of loading a model here; --model picks a served model (default: the first of "
        "/v1/models); the engine flags are then ignored",
    )
    chat.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="with --url: the server's API key (default: $OPENAI_API_KEY, else none)",
    )
    add_console_args(chat, default_max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(handler=run_chat)


def run_chat(args: argparse.Namespace) -> None:
    reply = remote_reply(args) if args.url else local_reply(args)
    _line_editing()
    chat_loop(reply, args.system)


def chat_loop(
    reply: Reply,
    system: str | None = None,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> list[dict]:
    """Read prompts until Ctrl-D, /exit or Ctrl-C at the prompt; returns the conversation."""
    start: list[dict] = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print("Chat with the model. /reset clears the history; Ctrl-C stops a reply; Ctrl-D quits.", file=err)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=err)
            return messages
        command = line.strip()
        if command == "/exit":
            return messages
        if command == "/reset":
            messages = list(start)
            print("Conversation cleared.", file=err)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        answer = _stream_reply(reply, messages, out, err)
        if answer is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": answer})


def _stream_reply(reply: Reply, messages: list[dict], out: TextIO, err: TextIO) -> str | None:
    """Write the reply as it comes; its text, all of it or up to a Ctrl-C; None if it failed."""
    pieces: list[str] = []
    try:
        with contextlib.closing(reply(messages)) as text:
            for piece in text:
                out.write(piece)
                out.flush()
                pieces.append(piece)
    except KeyboardInterrupt:
        out.write("\n")
        print("[reply stopped]", file=err)
        return "".join(pieces)
    except (ValueError, ReplyError) as error:  # e.g. the history outgrew max_model_len
        if pieces:
            out.write("\n")
        print(f"error: {error}", file=err)
        return None
    out.write("\n")
    return "".join(pieces)


def local_reply(args: argparse.Namespace) -> Reply:
    """Replies from an engine loaded here. The model's chat template renders within the server's
    default time budget and the characters a prompt of max_model_len can hold."""
    from pagedllm.tokenizer import chat_prompt, max_prompt_chars, max_token_chars

    engine = console_engine(args)
    params = sampling_params(args)
    max_chars = max_prompt_chars(engine.max_model_len, max_token_chars(engine.tokenizer))
    return lambda messages: reply_text(
        engine, chat_prompt(engine.tokenizer, messages, max_chars=max_chars), params
    )


def remote_reply(args: argparse.Namespace) -> Reply:
    """Replies streamed from a server's /v1/chat/completions."""
    base_url = args.url.rstrip("/").removesuffix("/v1") + "/v1"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=base_url, headers=headers, timeout=httpx.Timeout(600, connect=10))
    model = getattr(args, "model", None) or _first_model(client)
    body = _request_body(args) | {"model": model, "stream": True}

    def reply(messages: list[dict]) -> Generator[str, None, None]:
        try:
            with client.stream("POST", "/chat/completions", json=body | {"messages": messages}) as response:
                if response.is_error:
                    response.read()
                    raise ReplyError(f"{response.status_code}: {_error_message(response.text)}")
                for line in response.iter_lines():
                    data = line.removeprefix("data: ")
                    if data == line or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ReplyError(_error_message(data))
                    for choice in chunk.get("choices", []):
                        if piece := (choice.get("delta") or {}).get("content"):
                            yield piece
        except httpx.HTTPError as error:
            raise ReplyError(f"{base_url}: {error}") from None

    return reply


def _first_model(client: httpx.Client) -> str:
    try:
        response = client.get("/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise SystemExit(f"error: no model from {client.base_url}models: {error}") from None


def _request_body(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as OpenAI fields; vLLM's extensions only when they differ from their default."""
    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }
    extras = {
        "top_k": args.top_k,
        "min_p": args.min_p or None,
        "repetition_penalty": None if args.repetition_penalty == 1.0 else args.repetition_penalty,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos or None,
        "seed": getattr(args, "seed", None),
    }
    return body | {name: value for name, value in extras.items() if value is not None}


def _error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(text)["error"]["message"]
    return text


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
