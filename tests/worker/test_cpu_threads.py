"""The CPU thread count: core lists, fixed counts, and the adaptive rule (fewer threads while
other processes keep cores busy, all of them again once they leave)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.config import EngineConfig, parse_cores
from pagedllm.worker import cpu_threads
from pagedllm.worker.cpu_threads import CPUThreads


def test_core_lists_parse_and_bad_ones_name_the_field():
    assert parse_cores("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cores("1") == {1}
    for bad in ("a-b", "", "1,,2"):
        with pytest.raises(ValueError, match=r"^cpu_cores:"):
            parse_cores(bad)
    with pytest.raises(ValueError, match=r"^num_threads:"):
        EngineConfig(num_threads=0)


class FakeClock:
    """Wall time, this process's CPU time and the system's busy time, advanced by hand."""

    def __init__(self, monkeypatch) -> None:
        self.wall = self.own = self.system = 0.0
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(cpu_threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(cpu_threads, "_system_busy_seconds", lambda: self.system)

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.wall += seconds
        self.own += seconds * own_cores
        self.system += seconds * (own_cores + other_cores)


def test_threads_follow_the_cores_other_processes_leave_free(monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    set_threads = []
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)
    clock = FakeClock(monkeypatch)
    threads = CPUThreads(num_threads=None, cpu_cores=None)
    threads.start()
    assert set_threads == [4]
    clock.advance(1.0, own_cores=4, other_cores=2)
    threads.adjust()  # not yet time to look
    assert threads.threads == 4
    clock.advance(1.5, own_cores=3.6, other_cores=1.4)  # over the interval: 1.64 cores busy elsewhere
    threads.adjust()
    assert threads.threads == 4  # once, twice: could be a process starting up
    for _ in range(2):
        clock.advance(2.5, own_cores=2, other_cores=2)
        threads.adjust()
    assert threads.threads == 2 and set_threads[-1] == 2
    clock.advance(2.5, own_cores=2, other_cores=0.3)  # a small client beside it is not a core
    threads.adjust()
    assert threads.threads == 4
    for _ in range(3):
        clock.advance(2.5, own_cores=3, other_cores=8)  # never below one thread
        threads.adjust()
    assert threads.threads == 1


def test_a_fixed_count_never_changes(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    clock = FakeClock(monkeypatch)
    threads = CPUThreads(num_threads=1, cpu_cores=None)
    threads.start()
    clock.advance(10, own_cores=1, other_cores=5)
    threads.adjust()
    assert threads.threads == 1 and not threads.adaptive


def test_cpu_cores_pin_the_process():
    before = os.sched_getaffinity(0)
    try:
        first = min(before)
        threads = CPUThreads(num_threads=None, cpu_cores=str(first))
        assert os.sched_getaffinity(0) == {first} and threads.max_threads == 1 and not threads.adaptive
    finally:
        os.sched_setaffinity(0, before)
