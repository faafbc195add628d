"""Shared fixtures: the default model through pagedllm and, independently, through transformers;
and what keeps test servers from outliving the test process."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pytest
import torch

from pagedllm import LLM
from pagedllm.model.locate import default_model_path, resolve_model_folder

from .helpers import (
    TEST_ENGINE_ARGS,
    RemoteServer,
    parse_gguf_once,
    save_mechanism_model,
    shared_server_args,
)


def _interrupt(signum: int, _: FrameType | None) -> None:
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}")


_CACHE_DIR = tempfile.mkdtemp(prefix="pagedllm-test-cache-")


def pytest_sessionstart() -> None:
    """SIGTERM (`make test` stopped, a CI job cancelled) ends the run as Ctrl-C does: pytest then
    runs the fixtures' finalizers and the tests' `finally` blocks, which stop their servers.
    pagedllm's cache goes to a folder of the run's own (the test servers inherit it): timings
    taken while the suite loads the cores must not become the user's choices."""
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ["PAGEDLLM_CACHE_DIR"] = _CACHE_DIR


def pytest_sessionfinish() -> None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@dataclass
class Reference:
    """Hugging Face transformers on the same GGUF, loaded by transformers' own GGUF reader."""

    model: object
    tokenizer: object

    @torch.inference_mode()
    def greedy(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Each prompt's greedy tokens (stopping at EOS, as pagedllm does) and the logits of every
        step, generated in one left-padded batch: a step reads the weights once for all prompts,
        and batching moves float32 logits by rounding only (the near-tie rule covers it)."""
        width = max(len(ids) for ids in prompts)
        pad = self.tokenizer.eos_token_id
        out = self.model.generate(
            torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts]),
            attention_mask=torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
        results = []
        for row in range(len(prompts)):
            tokens = out.sequences[row, width:].tolist()
            if pad in tokens:  # a finished row is padded with EOS after its own
                tokens = tokens[: tokens.index(pad) + 1]
            results.append((tokens, [step[row].float() for step in out.logits[: len(tokens)]]))
        return results

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()

    @torch.inference_mode()
    def extend(self, token_ids: list[int], cache: object = None) -> tuple[torch.Tensor, object]:
        """The float32 logits at the last of `token_ids`, appended to the run whose KV cache is
        `cache` (None: a new run), and the cache to go on with: a step costs one token's forward."""
        out = self.model(torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
        return out.logits[0, -1:].float(), out.past_key_values


@pytest.fixture(scope="session")
def reference() -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    with pytest.MonkeyPatch.context() as patch:
        parse_gguf_once(patch)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    return Reference(model, tokenizer)


@pytest.fixture(scope="session")
def llm() -> LLM:
    """A float32 engine shared by tests that do not need special settings."""
    return LLM(**TEST_ENGINE_ARGS)


@pytest.fixture(scope="session")
def mechanism_model(tmp_path_factory) -> str:
    """helpers.save_mechanism_model's folder, written once per run."""
    return str(save_mechanism_model(tmp_path_factory.mktemp("mechanism-model")))


@pytest.fixture(scope="session")
def mechanism_args(mechanism_model) -> dict:
    """TEST_ENGINE_ARGS on the mechanism model."""
    return TEST_ENGINE_ARGS | {"model": mechanism_model}


@pytest.fixture(scope="session")
def server() -> Iterator[RemoteServer]:
    """The default model served with shared_server_args(), one process for the whole run: a start
    costs seconds, and most server tests need no flag of their own (a module that does defines its
    own `server`)."""
    remote = RemoteServer(shared_server_args())
    yield remote
    remote.stop()


@pytest.fixture(scope="session")
def default_hf_folder(tmp_path_factory) -> Path:
    """The default model as a plain Hugging Face folder: its GGUF's weights dequantized to float32
    (model.safetensors), config.json and the tokenizer (what a hub repo of it would hold)."""
    from safetensors.torch import save_file

    from pagedllm.layers.quantization import BlockQuantized
    from pagedllm.model.config_reader import GGUF_SOURCE, model_config_from_folder
    from pagedllm.model.gguf_weights import iter_gguf_weights

    folder = tmp_path_factory.mktemp("default-hf")
    converted = resolve_model_folder(None)
    for file in converted.iterdir():
        if file.name != GGUF_SOURCE:
            shutil.copy(file, folder / file.name)
    weights = iter_gguf_weights(default_model_path(), model_config_from_folder(converted))
    tensors = {name: w.dequantize() if isinstance(w, BlockQuantized) else w for name, w in weights}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
