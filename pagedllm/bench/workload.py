"""Benchmark request sets: JSONL, one request per line.

Single-turn sets have `prompt`, `max_tokens` and `ignore_eos`; conversation sets have
`conversation_id`, `system`, `turns` (user messages) and `max_tokens` per answer.
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


@dataclass(frozen=True)
class Conversation:
    conversation_id: int
    system: str
    turns: list[str]
    max_tokens: int


def is_conversation_workload(path: str | Path) -> bool:
    rows = _read_jsonl(path)
    return bool(rows) and "turns" in rows[0]


def load_requests(path: str | Path, limit: int | None = None) -> list[BenchRequest]:
    rows = _read_jsonl(path)
    if rows and "turns" in rows[0]:
        raise ValueError(f"{path} holds conversations; use a single-turn workload here")
    requests = [
        BenchRequest(r["prompt"], int(r["max_tokens"]), bool(r.get("ignore_eos", True))) for r in rows
    ]
    return requests[:limit] if limit else requests


def load_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    rows = _read_jsonl(path)
    conversations = [
        Conversation(int(r["conversation_id"]), r.get("system", ""), list(r["turns"]), int(r["max_tokens"]))
        for r in rows
    ]
    return conversations[:limit] if limit else conversations


def _read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
