"""The server's own flags: one ServerConfig field each, as EngineConfig's fields are the engine's
flags (config.py). `add_server_args` adds both groups to one parser, the parser of
`pagedllm serve` and of `python -m pagedllm.entrypoints.openai.api_server`.

A field's annotation picks its argparse shape (flags.py); a bool that is off by default is a
plain switch (`--flag`), any other bool gets its `--no-` twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm import limits
from pagedllm.config import EngineConfig, add_engine_args
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from pagedllm.flags import flag, flag_shape
from pagedllm.forkserver import RANK_PRELOAD, start_forkserver

API_KEY_ENV = "PAGEDLLM_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the same routes

UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
Runner = Literal["auto", "generate", "pooling"]
Task = Literal["generate", "embed", "score"]
_TASK_RUNNER = {"generate": "generate", "embed": "pooling", "score": "pooling"}


def _flag(help_text: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """A field's metadata: its whole --help text (defaults spelled as users read them)."""
    return {"help": help_text, "argparse": argparse_kwargs}


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP server does around the engine; ValueError on a bad value."""

    host: str = field(default="127.0.0.1", metadata=_flag("Address to listen on. (default: 127.0.0.1)"))
    port: int = field(default=8000, metadata=_flag("Port to listen on; 0 picks a free one. (default: 8000)"))
    served_model_name: list[str] | None = field(
        default=None,
        metadata=_flag(
            "Model name(s) the API answers to; the first is echoed in responses. "
            "(default: the model's name, e.g. SmolLM2-135M-Instruct)"
        ),
    )
    api_key: str | None = field(
        default_factory=lambda: os.environ.get(API_KEY_ENV),
        metadata=_flag(
            f"Require `Authorization: Bearer KEY` on every /v1 call. (default: ${API_KEY_ENV}, else none)"
        ),
    )
    max_queue_len: int | None = field(
        default=None,
        metadata=_flag(
            "Most requests waiting for a seat in the batch; past it a request gets 503 with Retry-After. "
            "(default: no limit)"
        ),
    )
    metrics_prefix: str = field(
        default="pagedllm",
        metadata=_flag(
            "Prefix of the /metrics names; `vllm` gives vLLM's exact names for its dashboards. "
            "(default: pagedllm)"
        ),
    )
    graceful_shutdown_timeout: int = field(
        default=30,
        metadata=_flag(
            "Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted. "
            "(default: 30)"
        ),
    )
    max_request_body_bytes: int = field(
        default=limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
        metadata=_flag(
            "Largest request body; a larger one gets 413 before it is read. "
            f"(default: {limits.DEFAULT_MAX_REQUEST_BODY_BYTES:,})"
        ),
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata=_flag(
            "Run chat templates sent by clients (`chat_template`, `chat_template_kwargs.chat_template`). "
            "A template is code: allow it only for clients you trust. (default: refused with a 400)"
        ),
    )
    chat_template_time_budget: float = field(
        default=limits.CHAT_TEMPLATE_TIME_BUDGET_S,
        metadata=_flag(
            "Seconds a chat template may take to render; past it the request gets a 400 (the "
            "offline LLM.chat and `pagedllm chat` use the default). "
            f"(default: {limits.CHAT_TEMPLATE_TIME_BUDGET_S:g})"
        ),
    )
    enable_auto_tool_choice: bool = field(
        default=True,
        metadata=_flag(
            'Serve tool_choice "auto": the model calls tools when it chooses, and --tool-call-parser '
            'reads the calls out of its text. "required" and a named function are always served '
            "(a grammar forces the call). (default: on)"
        ),
    )
    tool_call_parser: str = field(
        default="hermes",
        metadata=_flag(
            "How tool calls are written in the model's output: hermes = <tool_call>{...}</tool_call> "
            "(Hermes, Qwen2.5, SmolLM2). (default: hermes)",
            choices=sorted(TOOL_CALL_PARSERS),
        ),
    )
    metrics_caller_label: bool | None = field(
        default=None,
        metadata=_flag(
            "Export prefix-cache hits by caller (the request's `user`, at most "
            f"{limits.MAX_USER_CHARS} characters, 100 names) on /metrics. Turn off when `user` holds "
            "personal data and /metrics is scraped from outside. (default: on without --api-key, off with it)"
        ),
    )
    truncate_chat_history: bool = field(
        default=False,
        metadata=_flag(
            "A chat too long for max_model_len (after room for max_tokens) loses its oldest turns, "
            "never its system messages or its last message, instead of getting a 400; usage says how "
            "many messages and tokens went (dropped_messages, dropped_prompt_tokens). (default: off)"
        ),
    )
    divergence_text: bool = field(
        default=True,
        metadata=_flag(
            "Show the differing text where prompts stop sharing a prefix (GET /stats, /dashboard); "
            "it is your users' data: --no-divergence-text keeps offsets and counts only. (default: on)"
        ),
    )
    runner: Runner = field(
        default="auto",
        metadata=_flag(
            "Which routes serve the model (vLLM's --runner): generate = /v1/completions and "
            "/v1/chat/completions; pooling = /v1/embeddings, /rerank and /score (an embedding or "
            "reranker model); auto = all of them, from the one engine. (default: auto)"
        ),
    )
    task: Task | None = field(
        default=None,
        metadata=_flag(
            "vLLM's older name for --runner: generate = --runner generate; embed or score = --runner "
            "pooling. (default: none)"
        ),
    )
    lora_modules: list[str] | None = field(
        default=None,
        metadata=_flag(
            "LoRA adapters served from the start (with --enable-lora), each name=path (a PEFT folder or "
            'a GGUF LoRA file) or vLLM\'s JSON {"name": ..., "path": ..., "base_model_name": ...}; a '
            "request names one in `model`. (default: none)"
        ),
    )
    allow_runtime_lora_updating: bool = field(
        default_factory=lambda: os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
        metadata=_flag(
            "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora): any "
            f"client may then make the server read a path it names. (default: ${RUNTIME_LORA_ENV}, else off)"
        ),
    )
    uvicorn_log_level: UvicornLogLevel = field(
        default="warning",
        metadata=_flag("uvicorn's own log level; info adds a line per HTTP request. (default: warning)"),
    )

    def __post_init__(self) -> None:
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"--max-queue-len must be >= 0, got {self.max_queue_len}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(
                "--metrics-prefix must be a Prometheus name like pagedllm or vllm, "
                f"got {self.metrics_prefix!r}"
            )
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be >= 1")
        if self.chat_template_time_budget <= 0:
            raise ValueError("--chat-template-time-budget must be > 0")
        if self.task is not None and self.runner not in ("auto", _TASK_RUNNER[self.task]):
            wanted = _TASK_RUNNER[self.task]
            raise ValueError(f"--task {self.task} asks for --runner {wanted}, not {self.runner}")

    @property
    def serves(self) -> Runner:
        """The routes served: --runner, or what --task names."""
        return _TASK_RUNNER[self.task] if self.task is not None else self.runner  # type: ignore[return-value]

    @property
    def tool_parser(self) -> str | None:
        """The parser of tool_choice "auto"'s calls; None when --no-enable-auto-tool-choice."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def _argparse_kwargs(f: dataclasses.Field) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": f.metadata["help"], **f.metadata["argparse"]}
    if f.default_factory is not dataclasses.MISSING:
        kwargs["default"] = f.default_factory()  # when the parser is made (the environment then)
    else:
        kwargs["default"] = f.default
    return {
        **kwargs,
        **flag_shape(
            f, {"UvicornLogLevel": UvicornLogLevel, "Runner": Runner, "Task | None": Task}, plain_switch=True
        ),
    }


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags, then every engine flag (vLLM's names): the one parser of both entry points."""
    group = parser.add_argument_group("server")
    for f in dataclasses.fields(ServerConfig):
        group.add_argument(flag(f), **_argparse_kwargs(f))
    add_engine_args(parser)
    return parser


def make_arg_parser() -> argparse.ArgumentParser:
    return add_server_args(
        argparse.ArgumentParser(
            allow_abbrev=False,
            prog="python -m pagedllm.entrypoints.openai.api_server",
            description="OpenAI-compatible server (same flags as `pagedllm serve`).",
        )
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed flags (the engine's flags are left to engine_config_from_args)."""
    return ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})


def check_server_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with the parser's usage and error on a bad server flag."""
    try:
        server_config_from_args(args)
    except ValueError as error:
        parser.error(str(error))


def start_rank_forkserver(args: argparse.Namespace) -> None:
    """Where ranks will be forked on this host, start their forkserver before the server imports
    the engine: its own imports (~3 s) then run beside the server's, not after them."""
    size = getattr(args, "tensor_parallel_size", EngineConfig.tensor_parallel_size)  # absent: not given
    backend = getattr(args, "distributed_executor_backend", EngineConfig.distributed_executor_backend)
    if size > 1 and backend == "mp":
        start_forkserver(RANK_PRELOAD)
