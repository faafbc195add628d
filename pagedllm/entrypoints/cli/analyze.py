"""`pagedllm analyze prefix`: why a workload's prompts miss the prefix cache, before serving it."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from pagedllm.workload import Conversation, load_workload


def register(analyze: argparse.ArgumentParser) -> None:
    kinds = analyze.add_subparsers(dest="kind", required=True)
    parser = kinds.add_parser(
        "prefix",
        help="where a workload's prompts stop sharing a prefix, and the hit rate if that part moved",
    )
    parser.add_argument("--workload", required=True, help="JSONL of prompts or conversations (as bench)")
    parser.add_argument("--model", default=None, help="whose tokenizer and chat template (default model)")
    parser.add_argument("--block-size", type=int, default=16, help="the engine's --block-size (16)")
    parser.add_argument("--top", type=int, default=10, help="divergence points listed (10)")
    parser.add_argument(
        "--divergence-text",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show the differing text (--no-divergence-text: offsets and counts only)",
    )
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    # imported here: they load torch and transformers (seconds), which --help should not wait for
    from pagedllm.analysis.prefix_report import analyze_prompts, format_report
    from pagedllm.model.locate import resolve_model_folder
    from pagedllm.tokenizer import load_tokenizer, workload_turns

    tokenizer = load_tokenizer(resolve_model_folder(args.model))
    workload = load_workload(args.workload)
    turns = workload_turns(tokenizer, workload)
    prompts, computed = [p for p, _ in turns], [c for _, c in turns]
    report = analyze_prompts(
        prompts,
        args.block_size,
        lambda ids: str(tokenizer.decode(list(ids))),
        top=args.top,
        computed=computed,
    )
    print(f"{args.workload}:")
    if workload and isinstance(workload[0], Conversation):
        print(
            f"{len(workload):,} conversations replayed turn by turn, as `pagedllm bench` sends them; "
            "each answer stands in as max_tokens tokens (the model's own are not known here)"
        )
    print(format_report(report, with_text=args.divergence_text))
    if args.output_json:
        body = asdict(report) | {
            "groups": [g.as_dict(args.divergence_text, args.block_size) for g in report.groups]
        }
        with open(args.output_json, "w") as f:
            json.dump(body, f, indent=2)
