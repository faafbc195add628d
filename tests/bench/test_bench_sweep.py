"""`pagedllm bench sweep` on a tiny workload: every setting runs in its own process, the table and
JSON agree, the recommendation meets the SLO and is the fastest that does, and it is printed as a
serve command that parses."""

from __future__ import annotations

import json
import shlex

import pytest

from pagedllm.bench.sweep import SettingResult, mark, parse_grid, settings_of
from pagedllm.entrypoints.cli.main import build_parser, main

pytestmark = pytest.mark.slow  # every setting in a process of its own


def test_a_short_sweep_recommends_the_fastest_setting_within_the_slo(tmp_path, capsys):
    workload = tmp_path / "tiny.jsonl"
    prompts = ["The capital of France is", "Water boils at", "def add(a, b):", "Once upon a time"]
    workload.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4}) + "\n" for p in prompts))
    out = tmp_path / "sweep.json"
    main(
        ["bench", "sweep", "--workload", str(workload), "--grid", "max_num_seqs=1,4",
         "--set", "dtype=float32", "--set", "max_model_len=256", "--set", "kv_cache_memory_bytes=64MiB",
         "--slo-ttft-p95", "60s", "--output-json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    results = report["results"]
    assert [r["setting"] for r in results] == [{}, {"max_num_seqs": 1}, {"max_num_seqs": 4}] or [
        r["setting"] for r in results
    ] == [{}, {"max_num_seqs": 4}, {"max_num_seqs": 1}]
    assert all(r["error"] is None and r["output_throughput"] > 0 for r in results)
    best = max((r for r in results if r["meets_slo"]), key=lambda r: r["output_throughput"])
    assert report["recommended"] == best["setting"]
    command = shlex.split(report["serve_command"])
    assert command[:2] == ["pagedllm", "serve"] and "--dtype" in command
    build_parser().parse_args(command[1:])  # the printed command is one pagedllm accepts
    assert "recommended:" in printed and report["serve_command"] in printed


def test_grid_parsing_ordering_and_pareto():
    assert parse_grid(["max_num_seqs=8,16", "kv-cache-dtype=auto,int8"]) == {
        "max_num_seqs": [8, 16],
        "kv_cache_dtype": ["auto", "int8"],
    }
    settings = settings_of({"a": [1, 2], "b": [3]}, seed=0)
    assert settings[0] == {} and sorted(map(str, settings[1:])) == ["{'a': 1, 'b': 3}", "{'a': 2, 'b': 3}"]
    fast = SettingResult({"x": 1}, output_throughput=100, ttft_p95_s=2.0)
    slow_low = SettingResult({"x": 2}, output_throughput=50, ttft_p95_s=1.0)
    dominated = SettingResult({"x": 3}, output_throughput=40, ttft_p95_s=3.0)
    mark([fast, slow_low, dominated], slo_ttft_p95=1.5, slo_tpot_p50=None)
    assert (fast.pareto, slow_low.pareto, dominated.pareto) == (True, True, False)
    assert (fast.meets_slo, slow_low.meets_slo) == (False, True)


def test_sweep_takes_the_dataset_flags_of_bench_serve(tmp_path):
    """`--dataset-name random ...` as `bench serve` takes it: the same requests, which every
    setting then replays from a file as it does a workload's (the sweep above); a conversation
    workload is refused before any setting runs."""
    from pagedllm.bench.datasets import dataset_source, load_dataset_for
    from pagedllm.bench.sweep import sweep_requests
    from pagedllm.config import engine_config_from_args

    dataset = ["--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "3"]
    dataset += ["--random-range-ratio", "0.5", "--num-prompts", "3"]
    serve_args = build_parser().parse_args(["bench", "serve", *dataset, "--seed", "5"])
    sweep_args = build_parser().parse_args(["bench", "sweep", *dataset, "--set", "seed=5"])
    served, _ = load_dataset_for(serve_args, engine_config_from_args(serve_args))
    assert sweep_requests(sweep_args, {"seed": 5}) == served and len(served) == 3
    assert dataset_source(sweep_args) == "random"  # what the report's first line names

    conversations = tmp_path / "turns.jsonl"
    turns = {"conversation_id": 0, "system": "", "turns": ["Hi", "Bye"], "max_tokens": 4}
    conversations.write_text(json.dumps(turns) + "\n")
    with pytest.raises(SystemExit, match="holds conversations"):
        main(["bench", "sweep", "--workload", str(conversations)])
