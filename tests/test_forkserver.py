"""pagedllm/forkserver.py: a child forked from a forkserver that started earlier runs with the
environment its parent has at the child's own start, not the one the forkserver was started with."""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.forkserver import forkserver_context, run_in_environment, start_forkserver

VARIABLE = "PAGEDLLM_TEST_FORKSERVER_VARIABLE"


def write_variable(path: str) -> None:
    Path(path).write_text(os.environ.get(VARIABLE, "<unset>"))


def test_a_child_runs_with_the_environment_of_its_own_start(monkeypatch, tmp_path):
    monkeypatch.delenv(VARIABLE, raising=False)
    start_forkserver([])  # running from here on (or since an earlier test), without the variable
    monkeypatch.setenv(VARIABLE, "set after the forkserver started")
    seen = tmp_path / "seen"
    child = forkserver_context([]).Process(
        target=run_in_environment, args=(dict(os.environ), write_variable, str(seen))
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert seen.read_text() == "set after the forkserver started"
