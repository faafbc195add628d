"""The server's command line: vLLM's tuning-guide line starts and serves, every flag is documented,
and SIGTERM lets in-flight work finish, refuses new work and exits 0."""

from __future__ import annotations

import dataclasses
import signal
import threading

import httpx
import openai
import pytest

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli.main import build_parser, main
from pagedllm.entrypoints.openai import api_server
from pagedllm.model.loader import default_model_path

from .test_server import RemoteServer

SERVER_FLAGS = [
    "--host",
    "--port",
    "--served-model-name",
    "--api-key",
    "--max-queue-len",
    "--metrics-prefix",
    "--graceful-shutdown-timeout",
    "--uvicorn-log-level",
]
ENGINE_FLAGS = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)]


def test_serve_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in SERVER_FLAGS + ENGINE_FLAGS:
        assert flag in text, flag
    parser = api_server.make_arg_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    assert {flag for a in parser._actions for flag in a.option_strings} >= set(SERVER_FLAGS + ENGINE_FLAGS)


def test_serve_takes_the_model_as_argument_or_flag(monkeypatch):
    seen = []
    monkeypatch.setattr("pagedllm.entrypoints.cli.serve.run_server", seen.append)
    for argv in (
        ["serve", "m.gguf", "--port", "9"],
        ["serve", "--model", "m.gguf"],
        ["serve", "m.gguf", "--model", "m.gguf"],
    ):
        args = build_parser().parse_args(argv)
        args.handler(args)
        assert seen.pop().model == "m.gguf"
    args = build_parser().parse_args(["serve"])
    args.handler(args)
    assert "model" not in seen.pop()  # the engine's default model
    args = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    with pytest.raises(SystemExit):
        args.handler(args)


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(api_server.API_KEY_ENV, "from-env")
    assert api_server.make_arg_parser().parse_args([]).api_key == "from-env"
    assert api_server.make_arg_parser().parse_args(["--api-key", "flag"]).api_key == "flag"


def test_vllm_command_line_serves_then_sigterm_finishes_in_flight_work_and_exits_0():
    # vLLM's tuning-guide line with pagedllm in its place; --port 0 only so tests never collide.
    server = RemoteServer(
        [
            "--model",
            str(default_model_path()),
            "--gpu-memory-utilization",
            "0.9",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "4096",
            "--block-size",
            "16",
            "--enable-prefix-caching",
            "--kv-cache-dtype",
            "auto",
        ]
    )
    try:
        log = "".join(server.lines)
        assert "Maximum concurrency for 4,096 tokens per request" in log  # the engine's KV cache report
        assert "--gpu-memory-utilization is for CUDA devices" in log
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0]
        assert model.model_extra["max_model_len"] == 4096
        chat = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content and chat.usage.prompt_tokens_details.cached_tokens == 0

        finish_reasons: list[str | None] = []
        usage = []
        first_chunk = threading.Event()

        def stream_through_shutdown() -> None:
            stream = client.completions.create(
                model=model.id,
                prompt="Count: one, two,",
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                finish_reasons.extend(choice.finish_reason for choice in chunk.choices)
                usage.append(chunk.usage)
                first_chunk.set()

        streaming = threading.Thread(target=stream_through_shutdown)
        streaming.start()
        assert first_chunk.wait(120)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises((httpx.ConnectError, httpx.HTTPStatusError)):
            response = httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=10
            )
            response.raise_for_status()  # 503 if the socket still took the connection
        streaming.join(120)
        # The in-flight request ran to its end.
        assert finish_reasons[-1] == "length" and usage[-1].completion_tokens == 24
        assert server.proc.wait(60) == 0
        assert "Shutting down: new requests get 503" in "".join(server.lines)
    finally:
        server.stop(signal.SIGKILL)
