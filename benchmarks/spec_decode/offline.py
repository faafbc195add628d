"""Offline engines timed in turns: what backoff.py and structured.py share."""

from __future__ import annotations

import time
from collections.abc import Callable

from pagedllm import LLM
from pagedllm.outputs import RequestOutput

Run = Callable[[LLM], list[RequestOutput]]


def alternate(engines: dict[str, LLM], run: Run, repeats: int) -> tuple[dict[str, float], list[dict]]:
    """Each engine's output tokens/s over `repeats` rounds of `run`, the engines taking turns in
    each round (so drift on the host falls on all alike), and each round's outputs by engine."""
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    rounds = []
    for _ in range(repeats):
        outputs = {}
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs[name] = run(llm)
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.outputs[0].token_ids) for o in outputs[name])
        rounds.append(outputs)
    return {name: tokens[name] / seconds[name] for name in engines}, rounds


def close(engines: dict[str, LLM]) -> None:
    for llm in engines.values():
        llm.llm_engine.close()
