"""The sampler's draw for a step against the whole-vocabulary procedure it replaced, in one run.

    .venv/bin/python benchmarks/sampler.py
    .venv/bin/python benchmarks/sampler.py --rows 1 16 --vocab 151936
    .venv/bin/python benchmarks/sampler.py --generate 32

For each vocabulary size, row count, setting (temperature alone, top-k 50, top-p 0.95, both) and
kind of row (logits N(0, s^2) at temperature 1: s = 4, where a top-p row's 256 most likely tokens
hold its 0.95 of the mass, and s = 2, where they do not and it goes on to 4,096 or the whole row),
milliseconds per draw of the step's tokens (median of --repeats): pagedllm's Sampler, which cuts
each row among its candidates and draws noise for those only, and the procedure it had before (git
f4d76ea, reproduced here): every row of a step that cuts sorted whole, top-p on the mass before
top-k's cut, and torch's exponential_ over the whole vocabulary. Both on as many threads as torch
has.

With --generate N, instead: the default model's LLM.generate of N requests at once (64 tokens each,
EOS ignored, temperature 1) with top-p 0.95 and with top-k 50, output tokens/s with pagedllm's
Sampler and with the whole-vocabulary draw put in its place, the same engine: the latter run before
and after the former, and the better of its two runs kept.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler

SETTINGS = {"temperature": (None, 1.0), "top-k 50": (50, 1.0), "top-p 0.95": (None, 0.95), "both": (50, 0.95)}


def step_metadata(rows: int, vocab: int, top_k: int | None, top_p: float) -> SamplingMetadata:
    cuts = top_k is not None or top_p < 1
    return SamplingMetadata(
        all_greedy=False,
        is_greedy=torch.zeros(rows, dtype=torch.bool),
        temperature=torch.ones(rows),
        top_k=torch.full((rows,), top_k or vocab, dtype=torch.int64) if cuts else None,
        top_p=torch.full((rows,), top_p) if cuts else None,
        min_p=None,
        generators={},
        penalties=None,
        logit_bias=None,
        banned=None,
        num_logprobs=[None] * rows,
    )


def whole_vocabulary_draw(
    logits: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator
) -> list[int]:
    """The draw as git f4d76ea made it."""
    scaled = logits / metadata.temperature[:, None]
    if metadata.top_k is not None and metadata.top_p is not None:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[1])[None, :]
        drop = ranks >= metadata.top_k[:, None]
        probs = sorted_logits.softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) >= metadata.top_p[:, None]
        scaled = torch.empty_like(scaled).scatter_(
            1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf"))
        )
    probs = torch.softmax(scaled, dim=-1)
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1).tolist()


def median_ms(repeats: int, draw: Callable[..., object], *args: object) -> float:
    draw(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        draw(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def generate_rates(num_requests: int) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(disable_log_stats=True)
    prompts = [f"Write a short story about a lighthouse keeper, part {i}." for i in range(num_requests)]
    own_draw = Sampler._sample

    def whole_vocabulary(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return torch.tensor(whole_vocabulary_draw(logits, metadata, sampler.generator))

    print(f"# {describe_host()}; default model, {num_requests} requests at once; git {git_sha()}")
    print("| setting | whole vocabulary tok/s | pagedllm tok/s | speed-up |")
    print("|---|---|---|---|")
    for name, cut in (("top-p 0.95", {"top_p": 0.95}), ("top-k 50", {"top_k": 50})):
        params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, **cut)
        rates = {}
        for label, draw in (("whole", whole_vocabulary), ("own", own_draw), ("whole", whole_vocabulary)):
            Sampler._sample = draw  # type: ignore[method-assign]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            rate = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
            rates[label] = max(rates.get(label, 0.0), rate)
        Sampler._sample = own_draw  # type: ignore[method-assign]
        whole, own = rates["whole"], rates["own"]
        print(f"| {name} | {whole:.1f} | {own:.1f} | **{own / whole:.2f}x** |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--generate", type=int, metavar="N", help="time LLM.generate of N requests instead")
    args = parser.parse_args()
    if args.generate:
        return generate_rates(args.generate)
    print(f"# {describe_host()}; torch threads {torch.get_num_threads()}; git {git_sha()}")
    print("| vocab | rows | setting | logits s | whole vocabulary ms | pagedllm ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.device("cpu"), 0)
    for vocab in args.vocab:
        for rows in args.rows:
            for name, (top_k, top_p) in SETTINGS.items():
                metadata = step_metadata(rows, vocab, top_k, top_p)
                for spread in (4.0, 2.0):
                    logits = torch.randn(rows, vocab, generator=generator) * spread
                    before = median_ms(args.repeats, whole_vocabulary_draw, logits, metadata, generator)
                    now = median_ms(args.repeats, sampler, logits, metadata)
                    print(
                        f"| {vocab:,} | {rows} | {name} | {spread:g} | {before:.2f} | {now:.2f} | "
                        f"**{before / now:.1f}x** |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
