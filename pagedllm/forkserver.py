"""Child processes forked from one server process that imported their heavy modules once
(Python's forkserver; spawned where the platform has none).

A tensor-parallel rank and a grammar compile process both need torch (xgrammar imports it), ~3 s
of imports that a fresh interpreter pays at every start. Forked from the forkserver they start in
milliseconds, clean of the calling process's threads. The forkserver is one per process and takes
its preload list at its start: whoever starts it first names what it imports, and a later
`forkserver_context` call only adds a child that imports its own modules itself. It is started
with the environment of that moment, so each child is handed the environment as it is at its own
start (`run_in_environment`)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

RANK_PRELOAD = ["pagedllm.executor.multiproc"]
"""What a tensor-parallel rank imports, by name: a server starts the forkserver with it before it
imports any of it itself."""


def forkserver_context(preload: list[str]) -> ForkServerContext | SpawnContext:
    """The context to start children with; `preload`: the modules the forkserver imports, if this
    call is the first (a no-op once it runs)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


def start_forkserver(preload: list[str]) -> None:
    """Start the forkserver now, importing `preload` beside the caller's own start-up instead of
    after it (the caller does not wait for its imports)."""
    if isinstance(forkserver_context(preload), ForkServerContext):
        multiprocessing.forkserver.ensure_running()


def run_in_environment(environment: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """target(*args) with the environment the parent had when it started this child."""
    os.environ.clear()
    os.environ.update(environment)
    return target(*args)
