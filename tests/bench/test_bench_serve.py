"""`pagedllm bench serve`: the arrival process and the request sets on their own, then the command
against a real server on a random set (all at once, and paced at a rate with a concurrency cap),
a ShareGPT-format file and an old-style JSONL workload, checking the JSON adds up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pagedllm.bench.arrivals import arrival_times
from pagedllm.bench.datasets import random_requests, sharegpt_requests
from pagedllm.bench.serve_metrics import RequestRecord, ServeResult
from pagedllm.bench.serve_report import summary_table
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.cli.main import main as cli
from pagedllm.model.locate import resolve_model_folder
from pagedllm.tokenizer import load_tokenizer

from ..helpers import API_KEY, RemoteServer

METRICS = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_folder(None))


# ---- arrivals --------------------------------------------------------------------------------


def test_arrivals_all_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(1, 3.0) == [0.0]
    assert arrival_times(0, 3.0) == []


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_arrivals_gamma_gaps(burstiness: float, cv: float):
    """Gaps are gamma(shape=burstiness): coefficient of variation 1/sqrt(burstiness) (1 for Poisson),
    and the last arrival is exactly (n - 1) / rate."""
    times = np.array(arrival_times(20001, 50.0, burstiness, seed=3))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert times[-1] == pytest.approx(20000 / 50.0)
    assert gaps.mean() == pytest.approx(1 / 50.0)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_arrivals_seeded_and_even():
    assert arrival_times(50, 5.0, seed=1) == arrival_times(50, 5.0, seed=1)
    assert arrival_times(50, 5.0, seed=1) != arrival_times(50, 5.0, seed=2)
    assert np.diff(arrival_times(11, 4.0, math.inf)) == pytest.approx([0.25] * 10)
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, burstiness)


# ---- request sets ----------------------------------------------------------------------------


def test_random_lengths(tokenizer):
    requests = random_requests(tokenizer, 40, input_len=64, output_len=10, range_ratio=0.5, seed=7)
    assert len(requests) == 40
    for r in requests:
        assert 32 <= r.prompt_len <= 96
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)
        assert 5 <= r.max_tokens <= 15
    assert len({r.max_tokens for r in requests}) > 1 and len({r.prompt_len for r in requests}) > 1
    assert requests == random_requests(tokenizer, 40, input_len=64, output_len=10, range_ratio=0.5, seed=7)
    exact = random_requests(tokenizer, 8, input_len=16, output_len=8, seed=1, ignore_eos=True)
    assert [(r.prompt_len, r.max_tokens, r.ignore_eos) for r in exact] == [(16, 8, True)] * 8
    with pytest.raises(ValueError):
        random_requests(tokenizer, 2, input_len=16, output_len=8, range_ratio=1.0)


def test_random_shared_prefix(tokenizer):
    requests = random_requests(tokenizer, 5, input_len=24, output_len=4, prefix_len=16, seed=2)
    heads = {tuple(tokenizer(r.prompt).input_ids[:12]) for r in requests}
    assert len(heads) == 1
    assert all(r.prompt_len == 40 for r in requests)


def _sharegpt(path: Path) -> list[tuple[str, str]]:
    """Writes a ShareGPT-format file: four usable exchanges, one too short, one without an answer."""
    exchanges = [
        ("Tell me about the history of the printing press in Europe.", "It began with Gutenberg."),
        ("What are three good reasons to learn a second language?", "Travel, work and the brain."),
        ("Write a short poem about the sea at night, please.", "Dark waves hum below the moon."),
        ("Explain how a bicycle stays upright when it is moving.", "Steering and the wheels' motion."),
    ]
    data = [
        {"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for i, (q, a) in enumerate(exchanges)
    ]
    hi = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend"}]
    data += [
        {"id": "short", "conversations": hi},
        {"id": "alone", "conversations": [{"from": "human", "value": "Nobody answers this one."}]},
    ]
    path.write_text(json.dumps(data))
    return exchanges


def test_sharegpt_filter_and_lengths(tokenizer, tmp_path: Path):
    exchanges = _sharegpt(tmp_path / "sg.json")
    answers = {q: len(tokenizer(a).input_ids) for q, a in exchanges}
    requests = sharegpt_requests(tmp_path / "sg.json", tokenizer, 4, seed=0)
    assert sorted(r.prompt for r in requests) == sorted(answers)
    assert all(r.max_tokens == answers[r.prompt] for r in requests)
    assert all(r.prompt_len == len(tokenizer(r.prompt).input_ids) for r in requests)
    more = sharegpt_requests(tmp_path / "sg.json", tokenizer, 7, output_len=3, seed=0)
    assert len(more) == 7 and {r.prompt for r in more} == set(answers)  # three sent twice
    assert all(r.max_tokens == 3 for r in more)


# ---- metrics ---------------------------------------------------------------------------------


def test_summary_goodput_and_peaks():
    records = [
        RequestRecord(10, None, 5, 0.1, 0.5, start_s=0.0, itl_s=[0.1] * 4),
        RequestRecord(20, None, 1, 0.3, 0.3, start_s=0.2, itl_s=[]),
        RequestRecord(30, None, 3, 0.05, 2.05, start_s=0.9, itl_s=[1.0, 1.0]),
        RequestRecord(40, error="HTTP 500", start_s=1.0),
    ]
    result = ServeResult(records, elapsed_s=4.0)
    summary = result.summary(list(METRICS), [50.0, 99.0], {"ttft": 200.0, "tpot": 500.0})
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (60, 9)
    assert summary["request_throughput"] == 0.75
    assert summary["request_goodput"] == 0.25  # the second is too slow to start, the third to go on
    assert summary["total_token_throughput"] == 69 / 4.0
    assert summary["median_itl_ms"] == pytest.approx(100.0)
    assert summary["mean_tpot_ms"] == pytest.approx((100.0 + 1000.0) / 2)  # one-token answers have none
    assert summary["max_output_tokens_per_s"] == 7.0  # second 0: 5 + 1 + 1
    assert summary["max_concurrent_requests"] == 2  # at 0.2-0.5 s
    assert result.summary(["ttft"], [99.0], None)["request_goodput"] is None


def test_in_flight_is_counted_at_an_instant_and_labelled_apart_from_the_setting():
    """Two clients, each sending four short requests back to back within one second: never more
    than two in flight, though eight are active in that second."""
    records = [
        RequestRecord(5, None, 2, 0.05, 0.1, start_s=0.1 * i + 0.01 * client, itl_s=[0.05])
        for client in range(2)
        for i in range(4)
    ]
    summary = ServeResult(records, elapsed_s=1.0).summary(["ttft"], [99.0], None)
    assert summary["max_concurrent_requests"] == 2
    text = summary_table(
        summary, ["ttft"], [99.0], max_concurrency=2, request_rate=math.inf, prefix_hit_rate=None
    )
    rows = dict(line.rsplit(None, 1) for line in text.splitlines() if ":" in line)
    assert rows["Max concurrency (--max-concurrency):"] == rows["Most in flight at once (measured):"] == "2"


def test_flags_are_checked():
    parser = build_parser()
    base = ["bench", "serve", "--dataset-name", "random"]
    args = parser.parse_args([*base, "--goodput", "ttft:500", "e2el:3000", "--concurrency", "3"])
    assert dict(args.goodput) == {"ttft": 500.0, "e2el": 3000.0} and args.max_concurrency == 3
    for bad in (["--goodput", "itl:5"], ["--goodput", "ttft"], ["--percentile-metrics", "ttft,foo"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, *bad])
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--metric-percentiles", "0,50"])


# ---- against a server ------------------------------------------------------------------------


def _bench(server: RemoteServer, tmp_path: Path, capsys, *flags: str) -> dict:
    path = tmp_path / "result.json"
    cli(
        ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--output-json", str(path), *flags]
    )
    assert "Serving benchmark" in capsys.readouterr().out
    return json.loads(path.read_text())


def _check_consistent(report: dict, num_requests: int) -> None:
    """What any run must satisfy: totals add up, rates follow from them, percentiles are ordered."""
    requests = report["requests"]
    assert report["completed"] == report["num_requests"] == len(requests) == num_requests
    assert report["failed"] == report["num_failed"] == 0
    assert report["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert report["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert report["duration"] == report["elapsed_s"] > 0
    assert report["request_throughput"] == pytest.approx(num_requests / report["duration"])
    assert report["output_throughput"] == pytest.approx(report["total_output_tokens"] / report["duration"])
    total = report["total_input_tokens"] + report["total_output_tokens"]
    assert report["total_token_throughput"] == pytest.approx(total / report["duration"])
    for metric in METRICS:
        assert 0 < report[f"median_{metric}_ms"] <= report[f"p99_{metric}_ms"]
        assert report[f"mean_{metric}_ms"] <= report[f"p99_{metric}_ms"]
    assert report["mean_ttft_ms"] == pytest.approx(report["ttft_s"]["mean"] * 1e3)
    assert report["ttft_s"]["p50"] <= report["ttft_s"]["p95"] <= report["ttft_s"]["p99"]
    assert report["mean_e2el_ms"] == pytest.approx(report["e2e_s"]["mean"] * 1e3)


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_random_all_at_once(server, tmp_path: Path, capsys):
    report = _bench(
        server, tmp_path, capsys,
        "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "16",
        "--random-output-len", "8", "--ignore-eos", "--request-rate", "inf",
        "--goodput", "ttft:60000", "e2el:60000", "--metric-percentiles", "50,90,99",
    )  # fmt: skip
    _check_consistent(report, 6)
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in report["requests"]] == [(16, 8)] * 6
    assert report["request_rate"] == "inf" and report["max_concurrency"] is None
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert report["median_ttft_ms"] <= report["p90_ttft_ms"] <= report["p99_ttft_ms"]
    assert report["prefix_hit_rate"] is not None  # pagedllm reports cached tokens


def test_random_paced_with_concurrency_cap(server, tmp_path: Path, capsys):
    report = _bench(
        server, tmp_path, capsys,
        "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "16",
        "--random-output-len", "8", "--ignore-eos", "--request-rate", "4", "--max-concurrency", "2",
        "--goodput", "ttft:1", "--seed", "5",
    )  # fmt: skip
    _check_consistent(report, 6)
    assert (report["request_rate"], report["burstiness"], report["max_concurrency"]) == (4.0, 1.0, 2)
    assert report["request_goodput"] <= report["request_throughput"]
    spans = [(r["start_s"], r["start_s"] + r["e2e_s"]) for r in report["requests"]]
    assert max(start for start, _ in spans) >= 5 / 4 - 0.01  # the last arrival is (n - 1) / rate
    for start, _ in spans:  # never more than two in flight
        assert sum(s <= start < end for s, end in spans) <= 2


def test_sharegpt_file(server, tmp_path: Path, capsys, tokenizer):
    exchanges = _sharegpt(tmp_path / "sg.json")
    report = _bench(
        server, tmp_path, capsys,
        "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "4", "--ignore-eos",
        "--save-result", "--result-dir", str(tmp_path / "results"), "--save-detailed",
    )  # fmt: skip
    _check_consistent(report, 4)
    assert report["dataset_name"] == "sharegpt"
    expected = sorted(len(tokenizer(a).input_ids) for _, a in exchanges)
    assert sorted(r["output_tokens"] for r in report["requests"]) == expected
    saved = list((tmp_path / "results").glob("openai-infqps-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["completed"] == 4
    assert len(report["itls"]) == 4 and report["output_lens"] == [
        r["output_tokens"] for r in report["requests"]
    ]


def test_jsonl_workload_old_flags(server, tmp_path: Path, capsys):
    """The flags and keys benchmarks/vllm_compare/run.py and benchmarks/run_all.sh use."""
    workload = tmp_path / "w.jsonl"
    lines = [{"prompt": f"Count from {i} to twenty:", "max_tokens": 6} for i in range(4)]
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    report = _bench(
        server, tmp_path, capsys,
        "--served-model-name", "SmolLM2-135M-Instruct", "--workload", str(workload),
        "--num-requests", "3", "--concurrency", "2",
    )  # fmt: skip
    _check_consistent(report, 3)
    assert report["dataset_name"] == "jsonl" and report["concurrency"] == 2
    assert all(r["output_tokens"] == 6 for r in report["requests"])  # JSONL lines ignore EOS by default
    for key in ("output_throughput", "elapsed_s", "num_requests", "num_failed", "prefix_hit_rate"):
        assert key in report
    assert set(report["tpot_s"]) == {"p50", "p95", "p99", "mean"}


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_conversation_workload_can_ignore_eos(server, tmp_path: Path, capsys):
    """A conversation line with `ignore_eos` (benchmarks/spec_decode's sets) gets answers of
    exactly max_tokens through the chat endpoint."""
    workload = tmp_path / "chats.jsonl"
    lines = [
        {
            "conversation_id": i,
            "system": "",
            "turns": [f"Say hi to {name}."],
            "max_tokens": 40,
            "ignore_eos": True,
        }
        for i, name in enumerate(("Ann", "Bo"))
    ]
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    report = _bench(server, tmp_path, capsys, "--workload", str(workload))
    _check_consistent(report, 2)
    assert [r["output_tokens"] for r in report["requests"]] == [40, 40]


def test_needs_a_path(capsys):
    with pytest.raises(SystemExit, match="needs --dataset-path"):
        cli(["bench", "serve", "--dataset-name", "sharegpt"])
    assert build_parser().parse_args(["bench", "serve"]).dataset_path is None  # --workload is optional
