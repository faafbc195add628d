"""A model file is untrusted input (issue 45): every damaged or hostile file of the corpus
(tests/hostile_files.py: truncations, counts of 2^62, overlapping and retyped tensors, configs of
2e8 layers...) ends in one ModelLoadError line naming the file and what is wrong, within seconds
and without memory growing; on the command line, in `error: <that line>` and exit status 1.

Every case runs in this process through what `plan` and `serve` read (the config, checked against
the tensor headers); one child process runs them all again to bound their time and peak memory,
and a few run through the CLI itself (each costs seconds of imports)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedllm.model.config_reader import GGUF_SOURCE, model_config_from_folder
from pagedllm.model.errors import ModelLoadError
from pagedllm.model.gguf_convert import gguf_hf_config
from pagedllm.model.locate import resolve_model_folder
from pagedllm.model_loader import load_model
from pagedllm.planner import plan_capacity, read_model_config
from pagedllm.speculative_config import SpeculativeConfig

from ..hostile_files import all_cases, base_spec, build_gguf, write_hf

ROOT = Path(__file__).resolve().parents[2]
CASES = {case.name: case for case in all_cases()}
TIME_LIMIT_S = 10.0
"""Each case's answer: milliseconds in fact, but a loaded 2-core host may be slow."""
MAX_RSS_BYTES = 2**30


def _as_plan_reads(path: Path) -> None:
    read_model_config(str(path))


def _as_serve_reads(path: Path) -> None:
    model_config_from_folder(resolve_model_folder(str(path)))


@pytest.mark.parametrize("name", CASES)
def test_a_damaged_file_is_one_error_line_naming_it(name, tmp_path):
    case = CASES[name]
    path = case.make(tmp_path)
    for load in (_as_plan_reads, _as_serve_reads):
        start = time.monotonic()
        with pytest.raises(ModelLoadError) as error:
            load(path)
        assert time.monotonic() - start < TIME_LIMIT_S
        message = str(error.value)
        assert "\n" not in message and str(path) in message, message
        assert re.search(case.expect, message), message


def peak_rss_bytes() -> int:
    """This process's peak resident memory: its address space's own high-water mark (VmHWM), not
    ru_maxrss, which Linux carries across exec from the parent that forked it (a pytest process
    that has loaded models would count as the child's peak)."""
    match = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def _run_all_cases(folder: Path) -> dict:
    """Every case through both readers, in this process: what failed, the slowest, peak RSS."""
    failures, slowest = [], 0.0
    for case in all_cases():
        (folder / case.name).mkdir()
        path = case.make(folder / case.name)
        for load in (_as_plan_reads, _as_serve_reads):
            start = time.monotonic()
            try:
                load(path)
                failures.append(f"{case.name}: no error")
            except ModelLoadError as error:
                if "\n" in str(error) or not re.search(case.expect, str(error)):
                    failures.append(f"{case.name}: {error}")
            except Exception as error:
                failures.append(f"{case.name}: {type(error).__name__}: {error}")
            slowest = max(slowest, time.monotonic() - start)
    rss = peak_rss_bytes()
    return {"cases": len(all_cases()), "failures": failures, "slowest_s": slowest, "max_rss_bytes": rss}


def test_the_whole_corpus_answers_in_bounded_time_and_memory(tmp_path):
    """In a process of its own, so its peak RSS is the corpus's (imports included)."""
    code = (
        "import json, sys; from pathlib import Path; "
        "from tests.model.test_hostile_files import _run_all_cases; "
        "print(json.dumps(_run_all_cases(Path(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["cases"] >= 140 and summary["failures"] == []
    assert summary["slowest_s"] < TIME_LIMIT_S
    assert summary["max_rss_bytes"] < MAX_RSS_BYTES, summary


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_corpus_base_gguf_is_a_model_that_loads(arch, tmp_path):
    """Each case is damaged in one place only: its base plans and loads."""
    path = tmp_path / "base.gguf"
    path.write_bytes(build_gguf(base_spec(arch)))
    config = read_model_config(str(path))
    assert plan_capacity(config, "base", gguf_path=path).weights_bytes > 0
    folder = tmp_path / "converted"  # the folder conversion makes, less the tokenizer
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(gguf_hf_config(path)))
    (folder / GGUF_SOURCE).write_text(str(path))
    load_model(folder, model_config_from_folder(folder), torch.float32, torch.device("cpu"), 64)


def test_the_corpus_base_folder_is_a_model_that_loads(tmp_path):
    folder = write_hf(tmp_path / "base")
    config = model_config_from_folder(folder)
    assert plan_capacity(config, "base").weights_bytes > 0
    load_model(folder, config, torch.float32, torch.device("cpu"), 64)


def test_a_speculative_config_nested_30000_deep_is_a_clear_error():
    with pytest.raises(ValueError, match="nested too deep"):
        SpeculativeConfig.parse("[" * 30_000 + "]" * 30_000)
    with pytest.raises(ValueError, match=r"speculative_config\.method: must be a number"):
        SpeculativeConfig.parse(json.dumps({"method": [[["ngram"]]]}))


_CLI = """
import os, sys
from pagedllm.entrypoints.cli.main import main
from tests.model.test_hostile_files import peak_rss_bytes
try:
    main(sys.argv[1:])
finally:
    with open(os.environ["RSS_FILE"], "w") as file:
        file.write(str(peak_rss_bytes()))
"""


def _cli(argv: list[str], tmp_path: Path) -> tuple[int, list[str], float, int]:
    """(exit status, stderr's non-empty lines, seconds, the child's own peak RSS)."""
    rss_file = tmp_path / "rss.txt"
    env = os.environ | {"RSS_FILE": str(rss_file), "HF_HUB_OFFLINE": "1"}
    env.pop("PAGEDLLM_LOGGING_LEVEL", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _CLI, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    seconds = time.monotonic() - start
    return (
        done.returncode,
        [line for line in done.stderr.splitlines() if line.strip()],
        seconds,
        int(rss_file.read_text()),
    )


CLI_CASES = [
    ("generate", "gguf-block-count-2e8"),
    ("generate", "hf-torch-dtype-float1024"),
    ("plan", "gguf-version-99"),
    ("chat", "hf-vocab-2^31"),
    ("serve", "gguf-two-tensors-one-offset"),
]
_ARGS = {
    "generate": ["generate", "Hello", "--max-tokens", "1", "--model"],
    "chat": ["chat", "--model"],
    "plan": ["plan", "--model"],
    "serve": ["serve", "--port", "0", "--model"],
}


@pytest.mark.parametrize(
    ("command", "name"),
    [  # make test-fast keeps a server's; the whole suite each command's
        pytest.param(c, n, id=f"{c}-{n}", marks=[] if c == "serve" else [pytest.mark.slow])
        for c, n in CLI_CASES
    ],
)
def test_the_cli_prints_one_error_line_and_exits_1(command, name, tmp_path):
    case = CASES[name]
    path = case.make(tmp_path)
    status, lines, seconds, rss = _cli([*_ARGS[command], str(path)], tmp_path)
    assert status == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    last = lines[-1]
    assert last.startswith("error: ") and str(path) in last and re.search(case.expect, last), lines
    if command != "serve":  # the server logs its start-up lines at INFO
        assert len(lines) == 1, lines
    assert seconds < 120 and rss < MAX_RSS_BYTES  # seconds: imports on a busy host; the answer is ms


@pytest.mark.slow  # a CLI process of its own; the fast set keeps serve's and plan's
def test_generate_with_a_deeply_nested_speculative_config_is_one_error_line(tmp_path):
    nested = "[" * 30_000 + "]" * 30_000
    status, lines, _, _ = _cli(["generate", "Hi", "--speculative-config", nested], tmp_path)
    assert status == 1 and lines == ["error: speculative_config: nested too deep; it is one flat JSON object"]


@pytest.mark.parametrize("name", ["gguf-block-count-2e8", "hf-layers-1e9", "gguf-cut-in-data"])
def test_llm_raises_model_load_error(name, tmp_path):
    from pagedllm import LLM

    path = CASES[name].make(tmp_path)
    with pytest.raises(ModelLoadError, match=re.escape(str(path))):
        LLM(model=str(path))
