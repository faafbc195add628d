"""Workload files: request sets as JSONL, one request per line, read by the benchmarks, `pagedllm
analyze prefix` and the engine's warm-up (sampled sets, random and ShareGPT: bench/datasets.py).

Single-turn sets have `prompt`, `max_tokens` and `ignore_eos`; conversation sets have
`conversation_id`, `system`, `turns` (user messages), `max_tokens` per answer and, optionally,
`ignore_eos` (default false: a conversation's answers feed its next turns, so they end where the
model ends them unless a set asks for answers of fixed length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    ignore_eos: bool = True
    prompt_len: int | None = None
    """Prompt tokens, where the set knows them (sampled sets); servers report their own count."""


@dataclass(frozen=True)
class Conversation:
    conversation_id: int
    system: str
    turns: list[str]
    max_tokens: int
    ignore_eos: bool = False


def load_workload(path: str | Path, limit: int | None = None) -> list[BenchRequest] | list[Conversation]:
    """The first `limit` lines of either kind of set, read once; a `turns` field marks conversations."""
    rows = _read_jsonl(path)
    rows = rows[:limit] if limit else rows
    if rows and "turns" in rows[0]:
        return [
            Conversation(
                int(r["conversation_id"]),
                r.get("system", ""),
                list(r["turns"]),
                int(r["max_tokens"]),
                bool(r.get("ignore_eos", False)),
            )
            for r in rows
        ]
    return [BenchRequest(r["prompt"], int(r["max_tokens"]), bool(r.get("ignore_eos", True))) for r in rows]


def load_requests(path: str | Path, limit: int | None = None) -> list[BenchRequest]:
    """A single-turn set (benchmarks that send independent requests)."""
    workload = load_workload(path, limit)
    if workload and isinstance(workload[0], Conversation):
        raise ValueError(f"{path} holds conversations; use a single-turn workload here")
    return workload  # type: ignore[return-value]


def write_requests(path: str | Path, requests: list[BenchRequest]) -> None:
    """A single-turn set as a JSONL file load_workload reads back (prompt_len is not kept)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}))
            f.write("\n")


def _read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
