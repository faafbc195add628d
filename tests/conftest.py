"""Shared fixtures: the default model through pagedllm and, independently, through transformers;
and what keeps test servers from outliving the test process."""

from __future__ import annotations

import ctypes
import signal
import sys
from dataclasses import dataclass
from types import FrameType

import pytest
import torch

from pagedllm import LLM
from pagedllm.model.loader import default_model_path

# Small enough to keep the suite fast, large enough for every test prompt.
TEST_ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 1024,
    "kv_cache_memory_bytes": "256MiB",
    "disable_log_stats": True,
}


def server_engine_args() -> list[str]:
    """TEST_ENGINE_ARGS as `pagedllm serve` flags."""
    return [
        "--dtype",
        TEST_ENGINE_ARGS["dtype"],
        "--max-model-len",
        str(TEST_ENGINE_ARGS["max_model_len"]),
        "--kv-cache-memory-bytes",
        TEST_ENGINE_ARGS["kv_cache_memory_bytes"],
        "--disable-log-stats",
    ]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


def die_with_parent() -> None:
    """A test subprocess's `preexec_fn`: on Linux the kernel sends it SIGTERM when the thread that
    started it ends, so a test process killed outright (SIGKILL, no finalizer runs) leaves no server
    behind. That thread, not the process: start long-lived servers from the main thread."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _interrupt(signum: int, _: FrameType | None) -> None:
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}")


def pytest_sessionstart() -> None:
    """SIGTERM (`make test` stopped, a CI job cancelled) ends the run as Ctrl-C does: pytest then
    runs the fixtures' finalizers and the tests' `finally` blocks, which stop their servers."""
    signal.signal(signal.SIGTERM, _interrupt)


@dataclass
class Reference:
    """Hugging Face transformers on the same GGUF, loaded by transformers' own GGUF reader."""

    model: object
    tokenizer: object

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens (stopping at EOS, as pagedllm does) and the logits of every step."""
        out = self.model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.eos_token_id,
        )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        return tokens, [step[0].float() for step in out.logits]

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="session")
def reference() -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return Reference(model, tokenizer)


@pytest.fixture(scope="session")
def llm() -> LLM:
    """A float32 engine shared by tests that do not need special settings."""
    return LLM(**TEST_ENGINE_ARGS)


def assert_greedy_equal(
    ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], label: str
) -> None:
    """Token-exact, except that a divergence is accepted where the reference's top-2 logit gap
    at that step is below 1e-3 (a near tie that float rounding may flip); comparison stops there."""
    for step, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        if a != b:
            top2 = ref_logits[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 1e-3, f"{label}: step {step}: ours {a} != reference {b} with top-2 gap {gap:.2e}"
            return
    assert len(ours) == len(ref_tokens), f"{label}: ours {len(ours)} tokens, reference {len(ref_tokens)}"
