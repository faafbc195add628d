"""`pagedllm analyze prefix`: the divergence finder over a workload file, without an engine, and
the prefix-cache hit rate the file gets as it is and with each prompt's variable span moved to
its end (both computed by replaying the prompts' chained block hashes, as the engine keys them).

The hit rate here is the engine's with an unbounded cache: a prompt's leading full blocks already
seen are hits, at most all but its last token (one token is always computed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedllm.core.block_hash import extend_hashes, get_hash_function
from pagedllm.metrics.divergence import DivergenceFinder, DivergenceGroup


@dataclass
class PrefixReport:
    num_prompts: int
    prompt_tokens: int
    groups: list[DivergenceGroup]
    hit_rate: float
    hit_rate_moved: float
    """With each diverging prompt's differing span moved to the end of the prompt."""
    num_moved: int


def analyze_prompts(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    decode: Callable[[Sequence[int]], str] | None = None,
    hash_algo: str = "sha256",
    top: int = 10,
    computed: Sequence[Sequence[int]] | None = None,
) -> PrefixReport:
    """`computed[i]`: the tokens whose blocks the cache holds once prompt i is answered (a turn of
    a conversation: the prompt and the answer the next turn repeats); by default the prompt."""
    hash_fn = get_hash_function(hash_algo)
    finder = DivergenceFinder(block_size, decode, max_tokens=sum(len(p) for p in prompts) + 1)
    hashes = [extend_hashes([], p, block_size, hash_fn) for p in prompts]
    computed_hashes = (
        hashes if computed is None else [extend_hashes([], c, block_size, hash_fn) for c in computed]
    )
    ids = [finder.observe(p, h) for p, h in zip(prompts, hashes, strict=True)]
    divergences = finder.analyse()
    moved, moved_hashes, moved_computed = [], [], []
    for prompt, prompt_hashes, held, prompt_id in zip(prompts, hashes, computed_hashes, ids, strict=True):
        div = divergences.get(prompt_id) if prompt_id is not None else None
        if div is None:
            moved.append(prompt)
            moved_hashes.append(prompt_hashes)
            moved_computed.append(held)
        else:  # the shared text after the span comes forward; the span goes last
            moved.append([*prompt[: div.start], *prompt[div.end :], *prompt[div.start : div.end]])
            moved_hashes.append(extend_hashes([], moved[-1], block_size, hash_fn))
            moved_computed.append(moved_hashes[-1])
    return PrefixReport(
        num_prompts=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        groups=finder.report(top),
        hit_rate=replay_hit_rate(prompts, hashes, block_size, computed_hashes),
        hit_rate_moved=replay_hit_rate(moved, moved_hashes, block_size, moved_computed),
        num_moved=len(divergences),
    )


def replay_hit_rate(
    prompts: Sequence[Sequence[int]],
    block_hashes: Sequence[list[bytes]],
    block_size: int,
    computed_hashes: Sequence[list[bytes]] | None = None,
) -> float:
    """Prompt tokens found in an unbounded prefix cache fed in order with the prompts (their
    chained block hashes), or with what answering each computed where `computed_hashes` says."""
    seen: set[bytes] = set()
    hits = total = 0
    held = block_hashes if computed_hashes is None else computed_hashes
    for tokens, hashes, computed in zip(prompts, block_hashes, held, strict=True):
        hit_blocks = 0
        while hit_blocks < min(len(hashes), (len(tokens) - 1) // block_size) and hashes[hit_blocks] in seen:
            hit_blocks += 1
        hits += hit_blocks * block_size
        total += len(tokens)
        seen.update(computed)
    return hits / total if total else 0.0


def format_report(report: PrefixReport, with_text: bool = True) -> str:
    lines = [
        f"{report.num_prompts:,} prompts, {report.prompt_tokens:,} prompt tokens",
        f"prefix-cache hit rate as they are: {report.hit_rate:.1%}",
    ]
    if not report.groups:
        lines.append("no prompts stop sharing a prefix and agree again later: nothing to fix here")
        return "\n".join(lines)
    lines.append(
        f"hit rate with the variable part of {report.num_moved:,} prompts moved to their end: "
        f"{report.hit_rate_moved:.1%}"
    )
    lines.append("where prompts stop sharing, then agree again (most recoverable first):")
    for group in report.groups:
        if not with_text:
            group.variants = []
        lines.append(f"- {group.sentence()}")
    return "\n".join(lines)
