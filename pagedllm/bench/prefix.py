"""`pagedllm bench prefix`: the same traffic with prefix caching on and off, in one run.

Traffic is a closed loop of `--concurrency` clients: a client sends its next request when
its previous answer is complete. Single-turn workloads (shared_prefix.jsonl) send one
request per line; conversation workloads (multiturn.jsonl) replay each conversation turn
by turn through the chat template, with the model's own answers in the history, so turn
k+1 can hit everything turn k computed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench.throughput import git_sha
from pagedllm.config import add_engine_args, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.eval.scoring import tokens_until_divergence
from pagedllm.logger import configure_logging
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import chat_prompt
from pagedllm.workload import Conversation, load_workload

# A client is a generator: it yields (prompt, params), receives the answer text, yields the next.
Client = Generator[tuple[dict, SamplingParams], str, None]


@dataclass
class TurnRecord:
    client: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    reusable_tokens: int
    """Whole blocks of this prompt that the client's previous turn computed (prompt + answer):
    the most a prefix cache private to this conversation could hit."""


@dataclass
class ModeResult:
    records: list[TurnRecord]
    elapsed_s: float
    prompt_tokens_computed: int

    def hit_rate(self, records: list[TurnRecord] | None = None) -> float:
        records = self.records if records is None else records
        queries = sum(r.prompt_tokens for r in records)
        return sum(r.cached_tokens for r in records) / queries if queries else 0.0

    def ttft_quantiles(self) -> dict[str, float]:
        ttfts = sorted(r.ttft_s for r in self.records)
        cuts = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
        return {"p50": statistics.median(ttfts), "p95": cuts[94], "p99": cuts[98]}

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.records) / self.elapsed_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="shared_prefix.jsonl-like or multiturn.jsonl-like")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--num-requests", type=int, default=None, help="first N lines only")
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)


def _single_turn_client(prompt: str, max_tokens: int, ignore_eos: bool) -> Client:
    yield {"prompt": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def _conversation_client(
    tokenizer, system: str, turns: list[str], max_tokens: int, ignore_eos: bool = False
) -> Client:
    messages = [{"role": "system", "content": system}] if system else []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    for user_turn in turns:
        messages.append({"role": "user", "content": user_turn})
        answer = yield (chat_prompt(tokenizer, messages), params)
        messages.append({"role": "assistant", "content": answer})


def make_clients(path: str, tokenizer, limit: int | None) -> list[Client]:
    return [
        _conversation_client(tokenizer, item.system, item.turns, item.max_tokens, item.ignore_eos)
        if isinstance(item, Conversation)
        else _single_turn_client(item.prompt, item.max_tokens, item.ignore_eos)
        for item in load_workload(path, limit)
    ]


def run_closed_loop(engine: LLMEngine, clients: list[Client], concurrency: int) -> ModeResult:
    """Drive clients through the engine, `concurrency` at a time; one engine request per turn."""
    pending = iter(enumerate(clients))
    active: dict[str, tuple[int, int, Client]] = {}  # req_id -> (client index, turn, client)
    computed_by_client: dict[int, list[int]] = {}  # tokens whose K/V the client's last turn computed
    block_size = engine.config.block_size
    records: list[TurnRecord] = []
    computed_before = engine.get_stats().num_prompt_tokens_computed
    start = time.monotonic()

    def send(index: int, turn: int, client: Client, answer: str | None) -> bool:
        try:
            prompt, params = next(client) if answer is None else client.send(answer)
        except StopIteration:
            return False
        req_id = engine.add_request(f"c{index}-t{turn}", prompt, params)
        active[req_id] = (index, turn, client)
        return True

    def start_next_client() -> None:
        for index, client in pending:
            if send(index, 0, client, None):
                return

    for _ in range(concurrency):
        start_next_client()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished:
                continue
            index, turn, client = active.pop(output.request_id)
            metrics = output.metrics
            reusable = tokens_until_divergence(output.prompt_token_ids, computed_by_client.get(index, []))
            computed_by_client[index] = output.prompt_token_ids + output.outputs[0].token_ids[:-1]
            records.append(
                TurnRecord(
                    index,
                    turn,
                    len(output.prompt_token_ids),
                    output.num_cached_tokens,
                    len(output.outputs[0].token_ids),
                    metrics.time_to_first_token or 0.0,
                    metrics.e2e_latency or 0.0,
                    reusable // block_size * block_size,
                )
            )
            if not send(index, turn + 1, client, output.outputs[0].text):
                start_next_client()
    computed = engine.get_stats().num_prompt_tokens_computed - computed_before
    return ModeResult(records, time.monotonic() - start, computed)


def main(args: argparse.Namespace) -> None:
    configure_logging()
    base = engine_config_from_args(args, disable_log_stats=True)
    results: dict[str, ModeResult] = {}
    for mode, caching in (("on", True), ("off", False)):
        engine = LLMEngine(base.replace(enable_prefix_caching=caching))
        clients = make_clients(args.workload, engine.tokenizer, args.num_requests)
        results[mode] = run_closed_loop(engine, clients, args.concurrency)
        del engine
    report = _report(args, results)
    print(report.pop("text"))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


def _report(args: argparse.Namespace, results: dict[str, ModeResult]) -> dict:
    on, off = results["on"], results["off"]
    conversations = any(r.turn for r in on.records)
    later = [r for r in on.records if r.turn > 0] or sorted(on.records, key=lambda r: r.client)[1:]
    later_label = "after each conversation's first turn" if conversations else "after the first request"
    reusable = _reusable_rate(later) if conversations else None
    q_on, q_off = on.ttft_quantiles(), off.ttft_quantiles()
    rows = [
        ("prefix cache hit rate (all)", f"{on.hit_rate():.3f}", f"{off.hit_rate():.3f}"),
        (f"hit rate {later_label}", f"{on.hit_rate(later):.3f}", "-"),
        *(
            [("  most a per-conversation cache could hit", f"{reusable:.3f}", "-")]
            if reusable is not None
            else []
        ),
        ("prompt tokens computed", f"{on.prompt_tokens_computed:,}", f"{off.prompt_tokens_computed:,}"),
        *[(f"TTFT {q} s", f"{q_on[q]:.3f}", f"{q_off[q]:.3f}") for q in ("p50", "p95", "p99")],
        ("output tokens/s", f"{on.output_throughput:.1f}", f"{off.output_throughput:.1f}"),
        ("elapsed s", f"{on.elapsed_s:.1f}", f"{off.elapsed_s:.1f}"),
    ]
    lines = [
        f"workload: {args.workload} ({len(on.records)} requests, concurrency {args.concurrency}), "
        f"git {git_sha()}",
        "",
        f"{'':<48}{'caching on':>14}{'caching off':>14}",
    ]
    lines += [f"{name:<48}{a:>14}{b:>14}" for name, a, b in rows]
    saved = 1 - on.prompt_tokens_computed / off.prompt_tokens_computed if off.prompt_tokens_computed else 0.0
    lines += [
        "",
        f"TTFT p50 off/on: {q_off['p50'] / q_on['p50']:.1f}x lower with caching; "
        f"prompt compute saved: {saved:.1%}; throughput on/off: "
        f"{on.output_throughput / off.output_throughput:.2f}x",
    ]
    return {
        "text": "\n".join(lines),
        "workload": args.workload,
        "concurrency": args.concurrency,
        "git": git_sha(),
        "hit_rate": on.hit_rate(),
        "hit_rate_later": on.hit_rate(later),
        "reusable_rate_later": reusable,
        "ttft_on": q_on,
        "ttft_off": q_off,
        "ttft_p50_ratio": q_off["p50"] / q_on["p50"],
        "throughput_on": on.output_throughput,
        "throughput_off": off.output_throughput,
        "prompt_tokens_computed_on": on.prompt_tokens_computed,
        "prompt_tokens_computed_off": off.prompt_tokens_computed,
    }


def _reusable_rate(records: list[TurnRecord]) -> float:
    queries = sum(r.prompt_tokens for r in records)
    return sum(r.reusable_tokens for r in records) / queries if queries else 0.0
