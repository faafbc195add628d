"""Models by hub name (ORG/NAME), from a Hugging Face cache the tests write themselves: the cache
first, revisions, GGUF repos, a local path winning, one clear error on a miss, and no network call."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants

from pagedllm import LLM, SamplingParams
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.entrypoints.cli.main import main
from pagedllm.model.hub import HubModelNotFoundError
from pagedllm.model.locate import (
    default_model_path,
    locate_model,
    resolve_model_folder,
    resolve_tokenizer_folder,
)
from pagedllm.planner import read_model_config

from ..helpers import TEST_ENGINE_ARGS

REPO = "pagedllm-test/SmolLM2-hub"
MAIN, V1 = "a" * 40, "b" * 40  # commits: main, and the tag v1


def write_repo(cache: Path, repo_id: str, files: list[Path], commits: dict[str, str]) -> Path:
    """huggingface_hub's layout: models--ORG--NAME/{refs/REF -> commit, snapshots/COMMIT/FILE -> file}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for ref, commit in commits.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in files:
            (snapshot / file.name).symlink_to(file)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return repo


@pytest.fixture
def network_calls(monkeypatch) -> list[tuple]:
    """Every connection attempted; each one fails at once, as on a machine without network."""
    calls: list[tuple] = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return calls


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, network_calls, default_hf_folder) -> Path:
    """A hub cache holding REPO at main and at tag v1 (the default model's converted files), with
    HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at it. huggingface_hub reads both at import, so its
    `constants` are patched too."""
    cache = tmp_path / "hub"
    write_repo(cache, REPO, sorted(default_hf_folder.iterdir()), {"main": MAIN, "v1": V1})
    for name, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(cache))):
        monkeypatch.setenv(name, "1" if value is True else value)
        monkeypatch.setattr(constants, name, value)
    return cache


def snapshot(cache: Path, commit: str, repo_id: str = REPO) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit


@pytest.mark.slow  # an engine from the written cache; the fast set keeps the resolution tests
def test_hub_name_generates_like_the_default_model(hub_cache, network_calls, llm):
    hub_llm = LLM(model=REPO, **TEST_ENGINE_ARGS)
    assert hub_llm.llm_engine.facts.model_name == REPO  # the served name is the repo id, as in vLLM
    assert hub_llm.llm_engine.tokenizer_folder == snapshot(hub_cache, MAIN)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16)
    ours = [o.outputs[0].token_ids for o in hub_llm.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert network_calls == []


def test_flags_take_vllm_names():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--model", REPO, "--revision", "v1", "--download-dir", "/cache", "--tokenizer", "o/t"]
    config = engine_config_from_args(parser.parse_args([*argv, "--tokenizer-revision", "main"]))
    assert (config.model, config.revision, config.download_dir) == (REPO, "v1", "/cache")
    assert (config.tokenizer, config.tokenizer_revision) == ("o/t", "main")


def test_revision_picks_a_snapshot(hub_cache, network_calls):
    assert locate_model(REPO) == snapshot(hub_cache, MAIN)
    assert locate_model(REPO, revision="v1") == snapshot(hub_cache, V1)
    assert locate_model(REPO, revision=V1) == snapshot(hub_cache, V1)  # a commit needs no ref
    assert resolve_tokenizer_folder(REPO, revision="v1") == snapshot(hub_cache, V1)
    with pytest.raises(HubModelNotFoundError, match="revision v2"):
        locate_model(REPO, revision="v2")
    assert network_calls == []


def test_download_dir_is_the_cache_looked_in(hub_cache, tmp_path, monkeypatch, network_calls, capsys):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(HubModelNotFoundError, match=re.escape(str(tmp_path / "empty"))):
        locate_model(REPO)
    assert locate_model(REPO, download_dir=str(hub_cache)) == snapshot(hub_cache, MAIN)
    main(["plan", "--model", REPO, "--download-dir", str(hub_cache), "--revision", "main", "--json"])
    assert '"num_layers": 30' in capsys.readouterr().out.replace("\n", "")
    assert network_calls == []


def test_missing_repo_is_one_clear_error(hub_cache, network_calls, capsys):
    with pytest.raises(HubModelNotFoundError) as error:
        LLM(model="nobody/missing", **TEST_ENGINE_ARGS)
    message = str(error.value)
    for part in ("'nobody/missing'", "revision main", str(hub_cache), "HF_HUB_OFFLINE=1"):
        assert part in message, part
    assert f"`hf download nobody/missing --cache-dir {hub_cache}`" in message
    assert "local model folder or .gguf file" in message
    with pytest.raises(SystemExit) as exit_info:  # the planner says the same, with its own way out
        main(["plan", "--model", "nobody/missing"])
    assert exit_info.value.code == 2
    assert "HF_HUB_OFFLINE=1" in capsys.readouterr().err
    assert network_calls == []


def test_partial_snapshot_serves_the_planner_not_the_engine(hub_cache, network_calls):
    config_only = [resolve_model_folder(None) / "config.json"]
    write_repo(hub_cache, "org/config-only", config_only, {"main": MAIN})
    assert read_model_config("org/config-only").num_hidden_layers == 30
    assert read_model_config(REPO).num_hidden_layers == 30
    with pytest.raises(HubModelNotFoundError, match="without the files the engine reads"):
        locate_model("org/config-only")
    assert network_calls == []


def test_gguf_repo_takes_its_one_gguf_or_a_quant_tag(hub_cache, tmp_path, network_calls):
    gguf = default_model_path()
    write_repo(hub_cache, "org/one-GGUF", [gguf], {"main": MAIN})
    assert locate_model("org/one-GGUF") == snapshot(hub_cache, MAIN, "org/one-GGUF") / gguf.name
    other = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"
    other.symlink_to(gguf)  # never read: only its name counts
    write_repo(hub_cache, "org/two-GGUF", [gguf, other], {"main": MAIN})
    with pytest.raises(ValueError, match=r"2 \.gguf files .*org/two-GGUF:QUANT"):
        locate_model("org/two-GGUF")
    assert locate_model("org/two-GGUF:Q8_0").name == other.name
    assert locate_model("org/two-GGUF:q4_1").name == gguf.name
    assert network_calls == []


def test_local_directory_wins_over_the_hub(hub_cache, tmp_path, monkeypatch, network_calls):
    monkeypatch.chdir(tmp_path)
    local = Path(REPO)
    local.mkdir(parents=True)
    (local / "config.json").symlink_to(resolve_model_folder(None) / "config.json")
    assert locate_model(REPO) == local
    assert resolve_tokenizer_folder(REPO) == local
    Path("org/not-a-model").mkdir(parents=True)  # a path, even a wrong one, is never a hub name
    with pytest.raises(FileNotFoundError, match=r"give a folder with config\.json") as error:
        locate_model("org/not-a-model")
    assert not isinstance(error.value, HubModelNotFoundError)
    assert network_calls == []


def test_network_failure_is_the_clear_error(hub_cache, monkeypatch, network_calls):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(HubModelNotFoundError) as error:
        locate_model("nobody/missing")
    message = str(error.value)
    assert "offline mode is off and the download failed" in message
    assert "nobody/missing" in message and str(hub_cache) in message
    assert network_calls  # tried, and failed at the socket
    assert locate_model(REPO) == snapshot(hub_cache, MAIN)  # a cached repo needs no network
