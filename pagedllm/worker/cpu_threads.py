"""How many CPU threads the model's compute uses, and on which cores.

PyTorch splits each operation over its OpenMP threads and waits for the slowest. With one thread
per core that is fastest on a quiet machine; but when another process takes one of those cores,
every operation waits for the thread that lost its core, a thousand times a step: there fewer
threads win, on a quiet machine more do. Spinning less (GOMP_SPINCOUNT) or sleeping at once
(OMP_WAIT_POLICY=passive) helps a loaded machine but costs a quiet one (figures:
docs/benchmarks/vs_vllm.md, "Threads on a shared machine").

So by default the thread count follows the machine: all the cores this process may use while
they are free, one fewer for each core other processes keep busy (measured every 2 s from
/proc/stat against this process's own CPU time, and only after three checks in a row, so that a
process starting up does not count), back up as soon as they leave. A fixed
--num-threads turns that off; --cpu-cores pins the process to chosen cores.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from pagedllm.config import parse_cores

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
BUSY_CORE = 0.5
"""Another process counts as holding a core once it uses at least half of one."""
SUSTAINED_CHECKS = 3
"""Threads are taken away only after this many checks in a row saw the cores busy: a process
that starts up (a burst of a few seconds) is no reason; they come back at the first free check."""


class CPUThreads:
    """Sets torch's thread count on the thread that runs the model (OpenMP keeps it per thread)."""

    def __init__(self, num_threads: int | None, cpu_cores: str | None) -> None:
        if cpu_cores is not None:
            os.sched_setaffinity(0, parse_cores(cpu_cores))
        self.cores = sorted(os.sched_getaffinity(0))
        self.max_threads = num_threads or len(self.cores)
        self.adaptive = num_threads is None and len(self.cores) > 1
        self.threads = self.max_threads
        self._last: tuple[float, float, float] | None = None  # wall time, system busy s, own CPU s
        self._busy_checks = 0  # checks in a row that wanted fewer threads

    def start(self) -> None:
        """Apply the thread count (call on the thread that runs the model) and say so."""
        torch.set_num_threads(self.threads)
        logger.info(
            "CPU threads: %d on cores %s%s",
            self.threads,
            _ranges(self.cores),
            " (fewer while other processes keep some of these cores busy)" if self.adaptive else "",
        )
        self._last = self._sample()

    def adjust(self) -> None:
        """Cheap unless CHECK_INTERVAL_S has passed: then fit the thread count to the cores
        other processes leave free."""
        if not self.adaptive or self._last is None:
            return
        now = time.monotonic()
        if now - self._last[0] < CHECK_INTERVAL_S:
            return
        sample = self._sample()
        wall = sample[0] - self._last[0]
        others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / wall  # cores
        self._last = sample
        busy_cores = int(others + 1 - BUSY_CORE)  # 0.5 of a core counts as one
        wanted = max(1, min(self.max_threads, len(self.cores) - busy_cores))
        self._busy_checks = self._busy_checks + 1 if wanted < self.threads else 0
        if wanted < self.threads and self._busy_checks < SUSTAINED_CHECKS:
            return
        if wanted != self.threads:
            logger.info(
                "CPU threads: %d -> %d (other processes use %.1f of %d cores)",
                self.threads,
                wanted,
                others,
                len(self.cores),
            )
            self.threads = wanted
            torch.set_num_threads(wanted)

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), _system_busy_seconds(), time.process_time()


def _system_busy_seconds() -> float:
    """CPU seconds spent by everything on this process's cores (from /proc/stat), 0 without it."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0.0
    allowed = {f"cpu{core}" for core in os.sched_getaffinity(0)}
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name in allowed:
            # user nice system idle iowait irq softirq steal: all but idle and iowait is work
            ticks = [int(x) for x in fields[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(f"{start}-{core}" if core != start else f"{core}")
            start = None
    return ",".join(parts)
