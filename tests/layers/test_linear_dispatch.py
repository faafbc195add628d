"""Float projections on CPU dispatched by timing (layers/linear_dispatch.py): the choice follows the
timings it is given, one path per weight (a row's result never depends on the batch), is cached on
disk per host and reused, survives a corrupt cache, says what it chose, yields to --linear-backend,
and every path gives the same greedy tokens. No test asserts a timing: fake timers stand in where
the choice matters."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers import choose_impls, linear_dispatch
from pagedllm.layers.linear import Linear, cpu_linear, cpu_paths, onednn_linear
from pagedllm.layers.linear_dispatch import (
    QUANT_STREAMS,
    ROW_COUNTS,
    LinearDispatch,
    Timing,
    best_single,
    time_streams,
    timed_rows,
)

from ..helpers import TEST_ENGINE_ARGS

CPU = torch.device("cpu")


def _fake_timer(by_path: dict[str, list[float]]):
    """A timer answering `by_path` (seconds per ROW_COUNTS entry) and counting its calls."""

    def timer(weight, paths, rows):
        timer.calls += 1
        return Timing({name: [by_path[name][ROW_COUNTS.index(r)] for r in rows] for name in paths}, True)

    timer.calls = 0
    return timer


ONEDNN_WINS_FROM_64 = {  # few_rows 2x faster up to 32 rows, 2x slower from 64
    "few_rows": [1, 1, 1, 1, 1, 1, 4, 8, 32],
    "onednn": [2, 2, 2, 2, 2, 2, 2, 4, 16],
}


def _both_paths(weight: torch.Tensor) -> None:
    if set(cpu_paths(weight)) != {"few_rows", "onednn", "torch"}:
        pytest.skip(f"this CPU build packs {weight.dtype} for one path only")


def test_the_path_is_the_one_least_behind_the_fastest_at_its_worst_row_count():
    # few_rows: at worst 2x behind (512 rows); onednn: at worst 2x behind (1 row): a tie
    assert best_single(ROW_COUNTS, ONEDNN_WINS_FROM_64) == "few_rows"  # ties: the order of preference
    prompts_cost_more = ONEDNN_WINS_FROM_64 | {"few_rows": [1, 1, 1, 1, 1, 1, 4, 8, 40]}
    assert best_single(ROW_COUNTS, prompts_cost_more) == "onednn"
    reverse = {"few_rows": [2.0] * 9, "onednn": [1.0] * 9}
    assert best_single(ROW_COUNTS, reverse) == "onednn"  # no preference against a clear win


@given(
    st.lists(
        st.tuples(st.floats(1e-6, 1.0), st.floats(1e-6, 1.0), st.floats(1e-6, 1.0)),
        min_size=1,
        max_size=len(ROW_COUNTS),
    )
)
def test_no_path_is_less_behind_the_fastest_than_the_chosen_one(table):
    rows = ROW_COUNTS[: len(table)]
    seconds = {name: [cell[j] for cell in table] for j, name in enumerate(("few_rows", "onednn", "torch"))}
    fastest = [min(cell) for cell in table]
    worst = {name: max(t / f for t, f in zip(times, fastest, strict=True)) for name, times in seconds.items()}
    chosen = best_single(rows, seconds)
    assert all(worst[chosen] <= worst[name] for name in seconds)
    fastest_everywhere = [name for name, times in seconds.items() if times == fastest]
    if fastest_everywhere:
        assert chosen == fastest_everywhere[0]


def test_costly_products_are_not_timed():
    assert timed_rows(576, 576) == list(ROW_COUNTS)
    assert max(timed_rows(49152, 576)) == 128  # a vocabulary-sized head stops where a step's rows do


def test_the_timings_are_cached_on_disk_and_reused(tmp_path, monkeypatch):
    weight = torch.zeros(48, 64)
    _both_paths(weight)
    cache = tmp_path / "dispatch.json"
    timer = _fake_timer(ONEDNN_WINS_FROM_64)
    first = LinearDispatch(cache_path=cache, timer=timer)
    chosen = first.choose(weight, cpu_paths(weight))
    assert first.choose(weight, cpu_paths(weight)) == chosen  # same shape: timed once
    entry = json.loads(cache.read_text())["shapes"]["float32 48x64"]
    assert entry["rows"] == list(ROW_COUNTS) and set(entry["seconds"]) == {"few_rows", "onednn"}
    assert timer.calls == 1
    monkeypatch.setattr(linear_dispatch, "PROCESS_TIMINGS", {})  # a new process
    later = LinearDispatch(cache_path=cache, timer=timer)
    assert later.choose(weight, cpu_paths(weight)) == chosen
    assert timer.calls == 1 and later.num_timed == 0
    assert f"read from {cache}" in later.summary()


@pytest.mark.parametrize("faster", list(QUANT_STREAMS))
def test_quantized_weights_stream_the_way_timed_faster_here_once_per_host(faster, tmp_path):
    """quant_stream_ahead times a 1-row product with and without the kernel's prefetch (its
    result is the same either way), takes the faster, caches it, and says so."""
    cache = tmp_path / "dispatch.json"
    timer = _fake_timer({name: [1.0 if name == faster else 2.0] * len(ROW_COUNTS) for name in QUANT_STREAMS})
    first = LinearDispatch(cache_path=cache, stream_timer=timer)
    assert first.quant_stream_ahead() == QUANT_STREAMS[faster]
    assert first.quant_stream_ahead() == QUANT_STREAMS[faster] and timer.calls == 1
    assert f"quantized weights streamed with {faster}" in first.summary()
    later = LinearDispatch(cache_path=cache, stream_timer=timer)
    assert later.quant_stream_ahead() == QUANT_STREAMS[faster] and timer.calls == 1


@pytest.mark.parametrize(
    ("ours", "hardware", "chosen"),
    [(1.0, 0.95, "software prefetch"), (1.0, 0.91, "software prefetch"), (1.0, 0.85, "hardware prefetch")],
)
def test_a_near_tie_streams_with_our_prefetch(ours, hardware, chosen, tmp_path):
    """The hardware's prefetch alone is taken only when it times more than STREAM_MARGIN faster:
    on a busy host the timer puts the two within a few percent where a decode step differed far
    more, our way faster."""
    timer = _fake_timer(
        {"software prefetch": [ours] * len(ROW_COUNTS), "hardware prefetch": [hardware] * len(ROW_COUNTS)}
    )
    dispatch = LinearDispatch(cache_path=tmp_path / "dispatch.json", stream_timer=timer)
    assert dispatch.quant_stream_ahead() == QUANT_STREAMS[chosen]


@pytest.mark.skipif(not cpu_ops.serves_quant_linear(4, 64, 64), reason="no integer kernel on this build")
def test_the_quantized_stream_timing_runs_on_weights_beyond_the_cache(monkeypatch):
    """The real timer on the kernel, both ways, each path's passes over copies enough to overflow
    the last-level cache (a small shape here: many copies)."""
    monkeypatch.setattr("pagedllm.layers.linear_dispatch.QUANT_STREAM_SHAPE", (64, 256))
    dispatch = LinearDispatch(stream_timer=time_streams, cache_path=None)
    monkeypatch.setattr(dispatch, "_store", lambda key, entry: None)
    monkeypatch.setattr(dispatch, "_cache", lambda: {"shapes": {}})
    assert dispatch.quant_stream_ahead() in QUANT_STREAMS.values()


def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path, caplog, monkeypatch):
    weight = torch.zeros(48, 64)
    _both_paths(weight)
    cache = tmp_path / "dispatch.json"
    cache.write_text('{"shapes": {"float32 48x64": {"rows": [1], "sec')
    timer = _fake_timer(ONEDNN_WINS_FROM_64)
    with caplog.at_level(logging.WARNING):
        chosen = LinearDispatch(cache_path=cache, timer=timer).choose(weight, cpu_paths(weight))
    assert timer.calls == 1 and chosen == "few_rows"
    assert "ignoring the unreadable cache" in caplog.text
    assert "float32 48x64" in json.loads(cache.read_text())["shapes"]
    cache.write_text(json.dumps({"shapes": {"float32 48x64": {"rows": list(ROW_COUNTS), "seconds": "x"}}}))
    monkeypatch.setattr(linear_dispatch, "PROCESS_TIMINGS", {})  # a new process reads the file
    assert LinearDispatch(cache_path=cache, timer=timer).choose(weight, cpu_paths(weight)) == chosen
    assert timer.calls == 2


def test_unsettled_timings_are_timed_again_at_later_starts_keeping_each_cells_least(tmp_path, monkeypatch):
    """A busy start writes its timings marked unsettled; each later start (a new process) times the
    shape again and keeps each cell's least, until a start betters no cell; later loads in one
    process choose as its first load did, whatever the file says by then."""
    weight = torch.zeros(48, 64)
    _both_paths(weight)
    cache = tmp_path / "dispatch.json"
    monkeypatch.setattr(linear_dispatch, "TIMED_STARTS", 10)  # here a shape settles by its timings
    answers = iter(
        [
            {"few_rows": [2.0] * 9, "onednn": [1.0] * 9},  # start 1
            {"few_rows": [0.5] * 9, "onednn": [1.5] * 9},  # start 2: few_rows bettered
            {"few_rows": [0.49] * 9, "onednn": [0.99] * 9},  # start 3: nothing bettered by 5%
        ]
    )
    calls = []

    def busy(weight, paths, rows):
        calls.append(rows)
        return Timing({name: times[: len(rows)] for name, times in next(answers).items()}, False)

    def start(process: dict) -> tuple[str, LinearDispatch]:
        monkeypatch.setattr(linear_dispatch, "PROCESS_TIMINGS", process)
        dispatch = LinearDispatch(cache_path=cache, timer=busy)
        return dispatch.choose(weight, cpu_paths(weight)), dispatch

    def stored() -> dict:
        return json.loads(cache.read_text())["shapes"]["float32 48x64"]

    first_process: dict = {}
    chosen, dispatch = start(first_process)
    assert chosen == "onednn" and "1 had not settled" in dispatch.summary()
    assert stored()["settled"] is False and stored()["starts"] == 1
    assert start({})[0] == "few_rows"  # least of both starts: few_rows 0.5, onednn 1.0
    assert stored()["settled"] is False and stored()["seconds"]["onednn"][0] == 1.0
    assert start(first_process)[0] == "onednn" and len(calls) == 2  # this process's first timings
    assert start({})[0] == "few_rows" and stored()["settled"] is True and stored()["starts"] == 3
    assert stored()["seconds"]["few_rows"][0] == 0.49
    assert start({})[0] == "few_rows" and len(calls) == 3  # settled: read, not timed


def test_a_shape_that_never_settles_is_timed_at_most_timed_starts_times():
    rows, entry = [1, 2], None
    for start in range(1, linear_dispatch.TIMED_STARTS + 1):
        times = {"few_rows": [1.0 / start] * 2, "onednn": [2.0 / start] * 2}  # each start much faster
        entry = linear_dispatch.merge_starts(entry, rows, times, settled=False)
        assert entry["starts"] == start and entry["settled"] == (start == linear_dispatch.TIMED_STARTS)
    assert entry["seconds"]["few_rows"] == [1.0 / linear_dispatch.TIMED_STARTS] * 2


@pytest.mark.parametrize("timings", [ONEDNN_WINS_FROM_64, {"few_rows": [3] * 9, "onednn": [1] * 9}])
def test_a_dispatched_weight_is_packed_once_and_a_row_s_result_is_the_same_in_any_batch(timings, tmp_path):
    """Even where another path is faster at some row counts: prefix caching, chunking and speculation
    compute one token's row in products of different sizes and must give the same tokens."""
    gen = torch.Generator().manual_seed(4)
    layer = Linear(64, 48, bias=True)
    _both_paths(layer.weight)
    plain = layer.weight.detach().clone()
    dispatch = LinearDispatch(cache_path=tmp_path / "d.json", timer=_fake_timer(timings))
    layer.choose_impl(CPU, torch.float32, dispatch)
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(200, 64, generator=gen)
    together = layer(x)
    torch.testing.assert_close(together, F.linear(x, plain, layer.bias), rtol=1e-5, atol=1e-5)
    for rows in (1, 7, 63, 64):
        assert torch.equal(layer(x[:rows]), together[:rows]), rows
    assert (
        "float32 few_rows: 48x64 x1" in dispatch.summary() or "float32 onednn: 48x64 x1" in dispatch.summary()
    )


@pytest.mark.parametrize("backend", ["few_rows", "onednn", "torch"])
def test_the_backend_flag_forces_the_path(backend, tmp_path):
    gen = torch.Generator().manual_seed(5)
    layer = Linear(64, 48, bias=True)
    if backend not in cpu_paths(layer.weight):
        pytest.skip(f"{backend} cannot take a float32 weight on this CPU build")
    plain = layer.weight.detach().clone()
    timer = _fake_timer(ONEDNN_WINS_FROM_64)
    dispatch = LinearDispatch(backend, cache_path=tmp_path / "d.json", timer=timer)
    layer.choose_impl(CPU, torch.float32, dispatch)
    expected = {"few_rows": cpu_ops.few_rows_linear, "onednn": onednn_linear, "torch": cpu_linear}
    assert layer.impl is expected[backend] and timer.calls == 0
    for rows in (1, 200):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, plain, layer.bias), rtol=1e-5, atol=1e-5)
    assert f"forced by --linear-backend {backend}" in dispatch.summary()


def test_choose_impls_times_each_shape_once_and_logs_the_choice(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    layers = torch.nn.Sequential(Linear(64, 48), Linear(64, 48), Linear(32, 16))
    with caplog.at_level(logging.INFO, logger="pagedllm.layers.linear_dispatch"):
        choose_impls(layers, CPU, torch.float32)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Linear dispatch")]
    assert "48x64 x2" in line and "16x32 x1" in line
    if len(set(cpu_paths(torch.empty(48, 64))) - {"torch"}) > 1:  # a choice to time
        assert f"cached at {tmp_path}" in line and "timed 2 shapes" in line  # 48x64 once


PROMPTS = ["The capital of France is", "word " * 40 + "number 7:"]


@pytest.mark.slow  # an engine per CPU path
def test_every_path_gives_the_auto_path_s_greedy_tokens(mechanism_model):
    """The mechanism model (the default model's heads, random weights) in float32, greedy: the same
    tokens whatever computes the projections."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("auto", "few_rows", "onednn", "torch"):
        llm = LLM(mechanism_model, **TEST_ENGINE_ARGS, linear_backend=backend)
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    for backend in ("few_rows", "onednn", "torch"):
        assert tokens[backend] == tokens["auto"], backend
