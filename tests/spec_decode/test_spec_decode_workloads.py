"""benchmarks/spec_decode/workloads.py: the three request sets load as chat conversations of fixed
length, come out the same every time, and the grounded and code prompts hold the text their
answers should copy (what makes them worth drafting from); chat prompts hold none."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pagedllm.workload import Conversation, load_workload

from ..helpers import benchmark_module

workloads = benchmark_module("spec_decode/workloads.py")

_has_source = (
    subprocess.run(
        ["git", "cat-file", "-e", f"{workloads.SOURCE_COMMIT}^{{commit}}"],
        cwd=Path(workloads.__file__).parent,
        capture_output=True,
        check=False,
    ).returncode
    == 0
)
pytestmark = pytest.mark.skipif(not _has_source, reason="a shallow clone lacks the workloads' source commit")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("spec_workloads")
    return {name: workloads.write_workload(name, out) for name in workloads.WORKLOADS}


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_sets_load_as_fixed_length_chats(written: dict[str, Path], name: str) -> None:
    items = load_workload(written[name])
    assert len(items) == workloads.NUM_REQUESTS
    assert all(isinstance(c, Conversation) for c in items)
    assert all(c.ignore_eos and c.max_tokens == workloads.MAX_TOKENS and len(c.turns) == 1 for c in items)
    assert len({c.turns[0] for c in items}) == len(items), "a prompt repeated"


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_sets_are_deterministic(written: dict[str, Path], name: str) -> None:
    assert workloads.BUILDERS[name]() == workloads.BUILDERS[name]()


def test_grounded_prompts_hold_their_answers() -> None:
    for request in workloads.grounded_requests():
        prompt = request.turns[0]
        assert request.quote, request.source
        for line in request.quote.splitlines():
            assert line in prompt, (request.source, line)


def test_code_prompts_hold_the_file_and_the_function_they_name() -> None:
    for request in workloads.code_requests():
        prompt = request.turns[0]
        assert 60 <= request.quote.count("\n") <= 150
        assert request.quote in prompt
        name = re.search(r"`(\w+)`", prompt.rpartition("```")[2])  # in the task after the file
        assert name is not None and re.search(rf"def {name[1]}\b", request.quote), prompt[:200]


def test_chat_prompts_have_nothing_to_copy() -> None:
    for request in workloads.chat_requests():
        assert not request.quote and len(request.turns[0]) < 200
