"""The baseline pagedllm replaces: Hugging Face transformers `generate` on static batches.

Requests are taken in arrival order, 8 at a time, left-padded to the batch's longest prompt,
and each batch runs until its longest request is done; a traditional server reserves KV
memory for every slot at the maximum length. Same weights as the engine (the engine's own
converted folder), same dtype, same threads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.workload import BenchRequest


@dataclass
class NaiveResult:
    elapsed_s: float
    requested_tokens: int
    peak_used_tokens: int
    """Most KV tokens any batch really needed (prompts + requested outputs)."""
    reserved_tokens: int
    """What the static scheme reserves: batch size x max length."""

    @property
    def output_throughput(self) -> float:
        return self.requested_tokens / self.elapsed_s


class NaiveHF:
    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, padding_side="left"
        )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True
        ).eval()

    @torch.inference_mode()
    def run(self, requests: list[BenchRequest], batch_size: int, max_len: int) -> NaiveResult:
        peak_used = 0
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            self._generate(batch)
            prompt_lens = [len(self.tokenizer(r.prompt).input_ids) for r in batch]
            peak_used = max(peak_used, sum(p + r.max_tokens for p, r in zip(prompt_lens, batch, strict=True)))
        elapsed = time.perf_counter() - start
        return NaiveResult(elapsed, sum(r.max_tokens for r in requests), peak_used, batch_size * max_len)

    @torch.inference_mode()
    def decode_speed(self, prompt: str, num_tokens: int) -> float:
        """Tokens/s of one sequence after its first token (time to first token removed)."""
        request = BenchRequest(prompt, 1)
        t0 = time.perf_counter()
        self._generate([request])
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._generate([BenchRequest(prompt, num_tokens)])
        total = time.perf_counter() - t0
        return (num_tokens - 1) / (total - first)

    def _generate(self, batch: list[BenchRequest]) -> None:
        encoded = self.tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True)
        max_new = max(r.max_tokens for r in batch)
        ignore_eos = all(r.ignore_eos for r in batch)
        self.model.generate(
            **encoded,
            max_new_tokens=max_new,
            min_new_tokens=max_new if ignore_eos else 0,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )
