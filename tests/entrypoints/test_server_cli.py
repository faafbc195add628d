"""The command line: vLLM's tuning-guide line starts and serves, every flag is documented, SIGTERM
lets in-flight work finish while new work gets 503, Ctrl-C during the load exits cleanly,
`--version` needs no torch, and `chat` (local or --url) keeps its console clean and its
conversation through a Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import chat
from pagedllm.entrypoints.cli.generate import reply_text
from pagedllm.entrypoints.cli.main import COMMANDS, build_parser, main
from pagedllm.entrypoints.openai import server_config
from pagedllm.model.locate import default_model_path

from ..helpers import RemoteServer, die_with_parent, hears_ctrl_c, server_engine_args

ROOT = Path(__file__).parents[2]

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
    parser = server_config.make_arg_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    assert {flag for a in parser._actions for flag in a.option_strings} >= set(SERVER_FLAGS + ENGINE_FLAGS)


def test_serve_takes_the_model_as_argument_or_flag(monkeypatch):
    seen = []
    monkeypatch.setattr("pagedllm.entrypoints.openai.api_server.run_server", seen.append)
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
    monkeypatch.setenv(server_config.API_KEY_ENV, "from-env")
    assert server_config.make_arg_parser().parse_args([]).api_key == "from-env"
    assert server_config.make_arg_parser().parse_args(["--api-key", "flag"]).api_key == "flag"


@pytest.mark.slow
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
                max_tokens=200,  # still streaming when the late request comes
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                finish_reasons.extend(choice.finish_reason for choice in chunk.choices)
                usage.append(chunk.usage)
                first_chunk.set()

        # `pagedllm chat --url` against this server (here: it saves a second model load).
        console = subprocess.run(
            [sys.executable, "-m", "pagedllm", "chat", "--url", server.url, "--max-tokens", "4"],
            input="Hi\n/reset\n",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert console.returncode == 0, console.stderr
        assert console.stdout.strip() and "Conversation cleared." in console.stderr
        assert "error" not in console.stderr

        streaming = threading.Thread(target=stream_through_shutdown)
        streaming.start()
        assert first_chunk.wait(120)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal handled: the drain has begun
        # The port stays open through the drain; new work gets an OpenAI-shaped 503 to retry.
        late = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=30
        )
        assert late.status_code == 503 and late.headers["retry-after"]
        assert late.json()["error"]["code"] == "unavailable"
        streaming.join(120)
        # The in-flight request ran to its end.
        assert finish_reasons[-1] == "length" and usage[-1].completion_tokens == 200
        assert server.proc.wait(60) == 0
        log = "".join(server.lines)
        assert "Shutting down: new requests get 503" in log
        assert (
            server.lines[-1].rstrip().endswith("Server stopped: 1 requests finished during the drain, 0 cut")
        )
        serving = next(line for line in server.lines if "Serving the OpenAI API on" in line)
        assert "/dashboard" in serving and "/metrics" in serving
        assert "max_num_seqs 8, max_num_batched_tokens 2048" in serving and "prefix caching on" in serving
    finally:
        server.stop(signal.SIGKILL)


def _in_a_fresh_interpreter(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_version_and_help_do_not_import_torch():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for argv in (["--version"], ["--help"], ["serve", "--help"], ["router", "--help"], ["analyze", "--help"]):
        _in_a_fresh_interpreter(
            "import contextlib, io, sys\n"
            "from pagedllm.entrypoints.cli.main import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    try:\n"
            f"        main({argv!r})\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            f"assert {version!r} in out.getvalue() or 'help' in {argv[-1]!r}, out.getvalue()\n"
        )


def test_every_subcommand_is_listed_and_a_typo_is_an_error():
    parser = build_parser()  # every subcommand's real parser
    subparsers = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._actions[-1])))
    assert {a.dest: a.help for a in subparsers._choices_actions} == {
        name: help_line for name, (_, help_line) in COMMANDS.items()
    }
    assert all(len(subparsers.choices[name]._actions) > 1 for name in COMMANDS)  # more than --help
    with pytest.raises(SystemExit):
        build_parser(["servve"]).parse_args(["servve"])  # a typo is still an error


@pytest.mark.slow
def test_ctrl_c_during_the_model_load_exits_without_sigabrt():
    """A Ctrl-C as the weights load: exit 130 without SIGABRT; where the load was faster than the
    signal, the server drains and exits 0. Never served on: this test once waited forever, the
    suite run as a background job whose SIGINT the server inherited ignored (`hears_ctrl_c`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm", "serve", "--port", "0", *server_engine_args()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: (die_with_parent(), hears_ctrl_c()),
    )
    watchdog = threading.Timer(120, proc.kill)  # reading stdout must not wait forever
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Loading weights" in line:
                proc.send_signal(signal.SIGINT)  # on the engine thread, torch is reading weights
                break
        lines += proc.stdout.readlines()
        returncode = proc.wait(60)
    finally:
        watchdog.cancel()
        proc.kill()
    log = "".join(lines)
    assert "terminate called" not in log
    if "Server stopped" in log:  # the load finished first: the drain ran
        assert returncode == 0, log
    else:
        assert returncode in (130, -signal.SIGINT), log  # a shell shows either as 130
        assert "Interrupted while loading the model" in log, log


def _cut_on(piece_number: int) -> io.StringIO:
    """An output that receives a Ctrl-C on its nth write, as a terminal does mid-reply."""

    class Interrupted(io.StringIO):
        writes = 0

        def write(self, text: str) -> int:
            self.writes += 1
            if self.writes == piece_number:
                raise KeyboardInterrupt
            return super().write(text)

    return Interrupted()


def test_chat_loop_keys():
    def reply(messages):
        yield from ["Par", "is", "."]

    prompts = iter(["Capital of France?", "/reset", "Again?", "", "/exit", "never read"])
    err = io.StringIO()
    out = _cut_on(2)
    messages = chat.chat_loop(reply, "Be brief.", read=lambda _: next(prompts), out=out, err=err)
    # The first reply was cut after "Par"; /reset kept the system message; the second ran whole.
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Paris."},
    ]
    assert "[reply stopped]" in err.getvalue() and "Conversation cleared." in err.getvalue()

    def ctrl_c(_: str) -> str:
        raise KeyboardInterrupt

    assert chat.chat_loop(reply, read=ctrl_c, out=io.StringIO(), err=io.StringIO()) == []  # quits


def test_a_stopped_chat_reply_frees_its_blocks(llm):
    engine = llm.llm_engine
    free_before = engine.core.kv_cache_manager.block_pool.num_free_blocks
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    def reply(messages):
        return reply_text(engine, messages[-1]["content"], params)

    prompts = iter(["Once upon a time", "/exit"])
    messages = chat.chat_loop(reply, read=lambda _: next(prompts), out=_cut_on(4), err=io.StringIO())
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"]  # three pieces came
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache_manager.block_pool.num_free_blocks == free_before


def _read_until(fd: int, text: str, seen: list[str], since: int = 0, timeout: float = 180) -> int:
    """Read the terminal until `text` shows up after offset `since` (with "": until the output
    reaches `since`); the offset just past it."""
    deadline = time.monotonic() + timeout
    while (found := "".join(seen).find(text, since)) < 0:
        assert time.monotonic() < deadline, f"no {text!r} in:\n{''.join(seen)}"
        if select.select([fd], [], [], 1)[0]:
            try:
                seen.append(os.read(fd, 4096).decode(errors="replace"))
            except OSError:  # the child closed the terminal
                raise AssertionError(f"no {text!r} in:\n{''.join(seen)}") from None
    return found + len(text)


@pytest.mark.slow
def test_chat_in_a_terminal_ctrl_c_stops_the_reply_and_the_console_stays_clean():
    argv = [
        sys.executable,
        "-m",
        "pagedllm",
        "chat",
        *server_engine_args(),
        "--max-tokens",
        "400",
        "--ignore-eos",
    ]
    # the kernels built where this process keeps them: with HOME moved, torch would look under the
    # new HOME and build them again, and that build's two lines are meant to show
    from pagedllm.kernels import cpu_ops

    cpu_ops.is_built()
    build_folder = cpu_ops._build_folder(cpu_ops.build_name())
    assert build_folder is not None
    extensions = str(build_folder.parent)  # as given, torch adds no py3XX_cpu folder under it
    pid, fd = pty.fork()
    if pid == 0:  # the child: `pagedllm chat` on a terminal, where Ctrl-C sends it SIGINT
        os.environ["TORCH_EXTENSIONS_DIR"] = extensions
        os.environ["HOME"] = "/nonexistent"  # no readline history written
        hears_ctrl_c()
        os.execv(sys.executable, argv)
    seen: list[str] = []
    try:
        at = _read_until(fd, "> ", seen)
        os.write(fd, b"Count from one to a thousand.\n")
        at = _read_until(fd, "thousand.", seen, at)  # the terminal's echo
        _read_until(fd, "", seen, at + 12)  # a dozen characters of the reply
        os.write(fd, b"\x03")  # Ctrl-C mid-reply
        at = _read_until(fd, "[reply stopped]", seen, at)
        at = _read_until(fd, "> ", seen, at)
        os.write(fd, b"/reset\n")
        at = _read_until(fd, "Conversation cleared.", seen, at)
        _read_until(fd, "> ", seen, at)
        os.write(fd, b"\x04")  # Ctrl-D at the prompt quits
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "".join(seen)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    text = "".join(seen)
    assert "INFO" not in text and "Traceback" not in text, text
