"""The suffix proposer's cost a step on a long context: one 4,000-token context indexed, then
1,000 steps of one more token each, drafting 4 tokens a step.

    .venv/bin/python benchmarks/spec_decode/suffix_step.py [--repeats 3]

A step's drafting runs on the engine thread between model steps, so its time adds to every
decode step of a request that drafts; the figure to compare is a decode step's (ms), not zero.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pagedllm.cpu_features import describe_host
from pagedllm.spec_decode.suffix import SuffixProposer


def run_once(seed: int) -> tuple[float, float]:
    """(seconds to draft from the 4,000-token context, seconds a step after it)."""
    rng = np.random.default_rng(seed)
    text = rng.integers(0, 2000, size=5000, dtype=np.int32)
    text[2000:2500] = text[500:1000]  # some repetition to draft from
    proposer = SuffixProposer(24, 10, 1.0, 0.1)  # the tests' settings
    start = time.perf_counter()
    proposer.propose("r", text[:4000], 4)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for end in range(4001, 5001):
        proposer.propose("r", text[:end], 4)
    return first, (time.perf_counter() - start) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = [run_once(seed) for seed in range(args.repeats)]
    print(describe_host())
    print(f"first draft over 4,000 tokens: median {statistics.median(r[0] for r in runs) * 1e3:.1f} ms")
    print(
        f"a step after it: median {statistics.median(r[1] for r in runs) * 1e6:.0f} us ({args.repeats} runs)"
    )


if __name__ == "__main__":
    main()
