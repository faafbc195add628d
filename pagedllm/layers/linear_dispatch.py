"""Which path computes a float projection on CPU, chosen by timing the candidates on this host.

The few-rows kernel streams a weight once whatever the rows and beats oneDNN on decode-sized
batches where it was measured; oneDNN can win for prompts, and on AMX parts from ~16 rows
(issue 25). A rule by CPU name was wrong on hosts nobody had measured, so at first use each
distinct (dtype, out_features, in_features) shape is timed through every path that can take it
at the row counts steps produce (ROW_COUNTS), and every projection of that shape takes the path
whose worst ratio to the fastest over those row counts is smallest (the caller's order of
preference breaks ties).

One path per weight, not one per row count: the paths sum in different orders, and a token's
row must come out the same whatever else shares its step. Prefix caching, chunked prefill and
speculative decoding compute the same token's row in products of different sizes and must give
the same tokens as the plain path; a weight split between paths by row count broke that (and
held a second packed copy). The packed paths keep it; the unpacked FALLBACK (MKL, which picks its
kernels by shape) does not promise it, and serves only weights no packed path takes.

Timing: a random weight of the real shape, packed as the path packs it, in enough copies to
overflow the last-level cache (a decode step streams its weights from memory, not from cache);
each round times every (path, row count) cell once, rounds interleaved so a busy moment of the
host hits every cell alike, and each cell keeps its least time; rounds go on until one betters
no cell by more than SETTLED (or SECONDS_PER_SHAPE is spent). A product of more than
MAX_TIMED_FLOP is not timed (compute-bound, where the paths differ least, and slow to time): the
largest timed row count's choice serves it.

Quantized weights have one kernel, but how it streams them differs: prefetching 4 KiB ahead was
~1.2x faster than the hardware's own prefetch on one Zen 5 host and ~1.3x slower on another of
the same kind. `quant_stream_ahead` times a decode step's 1-row product both ways, once per host,
on a 4-bit weight of a 1B model's attention projections' size (QUANT_STREAM_SHAPE), as the median
of passes over copies of it (time_streams); every quantized projection streams with our prefetch
unless the hardware's alone timed more than STREAM_MARGIN faster. The results are the same either
way.

Cache: the timings (not the choices, so a change of rule needs no new timing) per host, in one
small JSON under the pagedllm cache dir, named from the CPU model and flags, the kernels' build,
torch's version, the thread count and oneDNN's ISA settings; later starts time nothing. An
unreadable file is ignored and rewritten. Timings that had not settled when their time ran out (a
busy host) are written marked so, and the next start times that shape again and keeps each cell's
least over the starts (merge_starts); a shape settles when a start betters none of the earlier
starts' cells, or after TIMED_STARTS starts. Before, unsettled timings were never written: a host
that never quiets down (a small VM) timed at every start. Within one process the first timings a
shape was given are kept (PROCESS_TIMINGS): a second engine there chooses as the first did,
whatever the file says by then, so two engines of one process compute the same bits (a plain run
and a cached, chunked or preempted one, compared token for token).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagedllm.cache_dir import cache_root
from pagedllm.config import LinearBackend
from pagedllm.cpu_features import cpu_flags, cpu_model_name, last_level_cache_bytes
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization import quantize

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
"""Decode steps of 1 to 128 requests, and a prompt chunk."""
MAX_TIMED_FLOP = 8e9
"""A vocabulary-sized head's product (~57 MFLOP a row) is timed up to 128 rows."""
MIN_ROUNDS, MAX_ROUNDS = 3, 8
SETTLED = 0.05
SECONDS_PER_SHAPE = 0.3
"""Rounds stop past this once MIN_ROUNDS ran: a model's 4-5 shapes in well under 2 s."""
FALLBACK = "torch"
"""The path that takes any weight (unpacked): used alone where no other takes it."""
QUANT_STREAMS = {"software prefetch": cpu_ops.QUANT_STREAM_AHEAD, "hardware prefetch": 0}
"""quant_linear's ways to stream a weight: its stream_ahead (0: the hardware's prefetch alone)."""
QUANT_STREAM_SHAPE = (4096, 2048)
"""Timed for quant_stream_ahead: 4.5 MiB at 4 bits, a 1B model's attention projections' size,
where how a stream starts matters most; its fused gate/up (18 MiB) told the two ways apart by
less than a decode step does, and not every time (docs/benchmarks/kernels_and_dispatch.md, "The
weights' stream")."""
STREAM_PASSES = 10
"""Passes over a path's copies for quant_stream_ahead."""
STREAM_MARGIN = 0.10
"""How much faster the hardware's prefetch alone must time to be chosen. A loop of products on a
busy host puts the two ways within a few percent of each other, either way round, where a decode
step ran ~1.3x faster with ours (docs/benchmarks/kernels_and_dispatch.md): a near tie goes to our
prefetch."""
TIMED_STARTS = 3
"""Starts that time a shape whose timings have not settled; the last one's least times are kept."""
PROCESS_TIMINGS: dict[tuple[str, str], dict[str, Any]] = {}
"""(cache file, shape key) -> the timings this process's first load of the shape used."""

LinearImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
Seconds = dict[str, list[float]]
"""Per path, the least seconds of one product at each timed row count."""


class LinearPath(NamedTuple):
    """A way to compute x @ Wᵀ (+ b): the weight packed once, then one call per product."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    run: LinearImpl


def best_single(rows: Sequence[int], seconds: Mapping[str, Sequence[float]]) -> str:
    """The path whose worst ratio to the fastest over the row counts is smallest (paths in order of
    preference: the first on ties)."""
    fastest = [min(times[i] for times in seconds.values()) for i in range(len(rows))]
    return min(seconds, key=lambda name: max(t / f for t, f in zip(seconds[name], fastest, strict=True)))


def timed_rows(n: int, k: int) -> list[int]:
    """The row counts timed for an [n, k] weight: those whose product is cheap enough to time."""
    return [rows for rows in ROW_COUNTS if rows == 1 or 2 * n * k * rows <= MAX_TIMED_FLOP]


class Timing(NamedTuple):
    seconds: Seconds
    settled: bool
    """Whether the last round bettered no cell by more than SETTLED: else the host was busy, and
    the timings are used but not cached."""


Timer = Callable[[torch.Tensor, Mapping[str, LinearPath], Sequence[int]], Timing]
"""(weight, paths, row counts) -> seconds of each path's product at each row count."""


def _packed_copies(plain: torch.Tensor, paths: Mapping[str, LinearPath]) -> dict[str, list[torch.Tensor]]:
    """Per path, enough packed copies of `plain` to overflow the last-level cache, taken in turn:
    each product then streams its weight from memory, as a decode step does."""
    copies = {}
    for name, path in paths.items():
        packed = path.pack(plain)
        packed_bytes = packed.numel() * packed.element_size()
        num_copies = min(64, math.ceil(2 * last_level_cache_bytes() / packed_bytes))
        copies[name] = [packed] + [packed.clone() for _ in range(num_copies - 1)]
    return copies


def time_paths(weight: torch.Tensor, paths: Mapping[str, LinearPath], rows: Sequence[int]) -> Timing:
    """Least seconds of each path's product at each row count, on random data of weight's shape."""
    n, k = weight.shape
    gen = torch.Generator().manual_seed(0)
    plain = (torch.randn(n, k, generator=gen) * 0.05).to(weight.dtype)
    copies = _packed_copies(plain, paths)
    uses = dict.fromkeys(paths, 0)
    inputs = [torch.randn(num_rows, k, generator=gen).to(weight.dtype) for num_rows in rows]
    seconds = {name: [math.inf] * len(rows) for name in paths}
    started, rounds, bettered = time.perf_counter(), 0, True
    with torch.no_grad():
        while rounds < MAX_ROUNDS:
            bettered = False
            for i, x in enumerate(inputs):
                for name, path in paths.items():  # alternating, so both see the same moments
                    packed = copies[name][uses[name] % len(copies[name])]
                    uses[name] += 1
                    start = time.perf_counter()
                    path.run(x, packed, None)
                    elapsed = time.perf_counter() - start
                    bettered |= elapsed < seconds[name][i] * (1 - SETTLED)
                    seconds[name][i] = min(seconds[name][i], elapsed)
            rounds += 1
            spent = time.perf_counter() - started
            if rounds >= MIN_ROUNDS and (not bettered or spent > SECONDS_PER_SHAPE):
                break
            if spent > 2 * SECONDS_PER_SHAPE:
                break
    return Timing(seconds, not bettered)


def time_streams(weight: torch.Tensor, paths: Mapping[str, LinearPath], rows: Sequence[int]) -> Timing:
    """quant_stream_ahead's timer: seconds of one product of `rows[0]` rows as the median over
    STREAM_PASSES passes, each path's pass running its copies one after another (a decode step's
    weights follow one another), the paths' passes alternating. The least single product
    (time_paths) is a lottery between two ways this close on a busy host: it once chose the way
    a decode step ran slower (docs/benchmarks/kernels_and_dispatch.md). Always settled: a median
    needs no rounds to settle, so it is cached."""
    n, k = weight.shape
    gen = torch.Generator().manual_seed(0)
    copies = _packed_copies(torch.randn(n, k, generator=gen) * 0.05, paths)
    x = torch.randn(rows[0], k, generator=gen)
    passes: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    with torch.no_grad():
        for _ in range(STREAM_PASSES):
            for name in order:
                start = time.perf_counter()
                for packed in copies[name]:
                    paths[name].run(x, packed, None)
                passes[name].append((time.perf_counter() - start) / len(copies[name]))
            order.reverse()  # each path goes first in half the rounds
    return Timing({name: [statistics.median(times)] for name, times in passes.items()}, True)


def host_key() -> str:
    """What decides the timings besides the shape: one cache file per distinct value."""
    return "; ".join(
        [
            cpu_model_name(),
            " ".join(sorted(cpu_flags())),
            f"torch {torch.__version__}",
            f"{torch.get_num_threads()} threads",
            cpu_ops.build_name(),
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')}",
            f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')}",
        ]
    )


def default_cache_path() -> Path:
    digest = hashlib.sha256(host_key().encode()).hexdigest()[:16]
    return cache_root() / "linear_dispatch" / f"{digest}.json"


class LinearDispatch:
    """The choices of one model's projections (one per model load): `choose` per weight, then
    `log_summary` once. `backend`: auto (timed), or the path every weight takes where it can."""

    def __init__(
        self,
        backend: LinearBackend = "auto",
        cache_path: Path | None = None,
        timer: Timer = time_paths,
        stream_timer: Timer = time_streams,
    ) -> None:
        self.backend = backend
        self.cache_path = cache_path
        self.timer = timer
        self.stream_timer = stream_timer
        self.num_timed = 0
        """Shapes timed by this dispatch (not read from the cache)."""
        self.num_unsettled = 0
        """Of those, shapes whose timings had not settled (a busy host): not cached."""
        self.seconds_timing = 0.0
        self._cached: dict[str, Any] | None = None
        self._chosen: dict[tuple[str, str], list[str]] = {}
        """(dtype, path) -> the shapes given it, one entry per weight."""
        self._quant_stream: str | None = None
        """How quantized weights stream (a QUANT_STREAMS name), once asked."""

    def choose(self, weight: torch.Tensor, paths: Mapping[str, LinearPath]) -> str:
        """The path for an [N, K] float weight; `paths`: those that can take it, in order of
        preference, FALLBACK last."""
        shape = f"{weight.shape[0]}x{weight.shape[1]}"
        dtype = str(weight.dtype).removeprefix("torch.")
        if self.backend != "auto":
            chosen = self.backend if self.backend in paths else FALLBACK
        else:
            candidates = {name: path for name, path in paths.items() if name != FALLBACK}
            if len(candidates) > 1:
                chosen = self._timed_choice(weight, f"{dtype} {shape}", candidates)
            else:
                chosen = next(iter(candidates), FALLBACK)
        self._chosen.setdefault((dtype, chosen), []).append(shape)
        return chosen

    def quant_stream_ahead(self) -> int:
        """quant_linear's stream_ahead on this host: our prefetch, unless the hardware's alone
        timed more than STREAM_MARGIN faster at one row."""
        if self._quant_stream is None:
            paths = {name: _quant_stream_path(ahead) for name, ahead in QUANT_STREAMS.items()}
            weight = torch.empty(QUANT_STREAM_SHAPE)
            key = "quantized 4-bit {}x{}, median of passes".format(*QUANT_STREAM_SHAPE)
            seconds = self._timings(weight, key, paths, [1], self.stream_timer)
            ours, hardware = seconds["software prefetch"][0], seconds["hardware prefetch"][0]
            faster = hardware * (1 + STREAM_MARGIN) < ours
            self._quant_stream = "hardware prefetch" if faster else "software prefetch"
        return QUANT_STREAMS[self._quant_stream]

    def _timed_choice(self, weight: torch.Tensor, key: str, paths: Mapping[str, LinearPath]) -> str:
        rows = timed_rows(*weight.shape)
        return best_single(rows, self._timings(weight, key, paths, rows, self.timer))

    def _timings(
        self,
        weight: torch.Tensor,
        key: str,
        paths: Mapping[str, LinearPath],
        rows: Sequence[int],
        timer: Timer,
    ) -> Seconds:
        """Each path's seconds at each row count: this process's first timings of the shape, else
        the cache's settled ones, else timed (and cached, settled or not)."""
        rows = list(rows)
        memo = (str(self._path()), key)
        entry: dict[str, Any] | None = PROCESS_TIMINGS.get(memo)
        if entry is None or not _valid(entry, paths, rows):
            stored = self._cache()["shapes"].get(key)
            stored = stored if _valid(stored, paths, rows) else None
            if stored is not None and stored.get("settled") is not False:
                entry = stored
            else:
                self.num_timed += 1
                seconds, settled = self._time(weight, paths, rows, timer)
                entry = merge_starts(stored, rows, seconds, settled)
                logger.debug("Linear dispatch timed %s: %s", key, entry)
                self.num_unsettled += not entry["settled"]
                self._store(key, entry)
            PROCESS_TIMINGS[memo] = entry
        self._cache()["shapes"][key] = entry  # this load's other weights of the shape
        return {name: entry["seconds"][name] for name in paths}

    def _time(
        self, weight: torch.Tensor, paths: Mapping[str, LinearPath], rows: Sequence[int], timer: Timer
    ) -> Timing:
        started = time.perf_counter()
        timing = timer(weight, paths, rows)
        self.seconds_timing += time.perf_counter() - started
        return timing

    def _path(self) -> Path:
        return self.cache_path or default_cache_path()

    def _cache(self) -> dict[str, Any]:
        if self._cached is None:
            self._cached = _read(self._path())
        return self._cached

    def _store(self, key: str, entry: dict[str, Any]) -> None:
        """Add `entry` to the file as it is now (another rank may have written it meanwhile),
        replaced whole: a reader sees the old file or the new, never half of one."""
        path = self._path()
        cached = _read(path)
        cached["shapes"][key] = entry
        try:
            _write_whole(path, cached)
        except OSError as err:  # a read-only cache dir: the next start times again
            logger.warning("Linear dispatch: could not cache the timings at %s: %s", path, err)

    def summary(self) -> str | None:
        """One line: where the choices come from and, per dtype and path, the shapes given it."""
        if not self._chosen and self._quant_stream is None:
            return None
        if self.backend != "auto":
            source = f"forced by --linear-backend {self.backend}"
        elif self.num_timed:
            source = f"timed {self.num_timed} shapes in {self.seconds_timing:.1f} s, cached at {self._path()}"
            if self.num_unsettled:
                source += (
                    f"; {self.num_unsettled} had not settled (a busy host?): timed again at the next"
                    f" start, for at most {TIMED_STARTS} starts"
                )
        else:
            source = f"read from {self._path()}" if self._cached is not None else "nothing to time"
        groups = [
            f"{dtype} {path}: "
            + ", ".join(f"{shape} x{shapes.count(shape)}" for shape in dict.fromkeys(shapes))
            for (dtype, path), shapes in self._chosen.items()
        ]
        if self._quant_stream is not None:
            groups.append(f"quantized weights streamed with {self._quant_stream}")
        return f"Linear dispatch ({source}): {'; '.join(groups)}"

    def log_summary(self) -> None:
        line = self.summary()
        if line is not None:
            logger.info("%s", line)


def _quant_stream_path(stream_ahead: int) -> LinearPath:
    """The integer kernel on a float weight quantized to 4 bits, streamed `stream_ahead` ahead."""

    def pack(weight: torch.Tensor) -> torch.Tensor:
        quantized = quantize(weight, 4)
        return cpu_ops.pack_quant_linear(quantized.q, quantized.scales, quantized.mins, 4)

    def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = QUANT_STREAM_SHAPE
        return cpu_ops.quant_linear(x, packed, 4, n, k, bias, stream_ahead)

    return LinearPath(pack, run)


def merge_starts(
    previous: dict[str, Any] | None, rows: list[int], seconds: Seconds, settled: bool
) -> dict[str, Any]:
    """A shape's cache entry after this start's timing: each cell's least over the starts that
    timed it (`previous`: the earlier starts' unsettled entry). Settled when this start's rounds
    settled, when they bettered no earlier cell by more than SETTLED, or at the TIMED_STARTS-th
    start."""
    if previous is None:
        return {"rows": rows, "seconds": seconds, "settled": settled, "starts": 1}
    starts = previous.get("starts")
    starts = (starts if isinstance(starts, int) and starts >= 1 else 1) + 1
    cells = {
        name: list(zip(times, previous["seconds"][name], strict=True)) for name, times in seconds.items()
    }
    bettered = any(now < before * (1 - SETTLED) for pairs in cells.values() for now, before in pairs)
    least = {name: [min(pair) for pair in pairs] for name, pairs in cells.items()}
    return {
        "rows": rows,
        "seconds": least,
        "settled": settled or not bettered or starts >= TIMED_STARTS,
        "starts": starts,
    }


def _valid(entry: object, paths: Mapping[str, LinearPath], rows: Sequence[int]) -> bool:
    """A cached entry times exactly these paths at these rows, with positive numbers."""
    if not isinstance(entry, dict) or entry.get("rows") != list(rows):
        return False
    seconds = entry.get("seconds")
    return (
        isinstance(seconds, dict)
        and set(seconds) == set(paths)
        and all(
            isinstance(times, list)
            and len(times) == len(rows)
            and all(isinstance(t, int | float) and 0 < t < math.inf for t in times)
            for times in seconds.values()
        )
    )


def _write_whole(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(data, file, indent=1)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _read(path: Path) -> dict[str, Any]:
    """The cache file's contents; an empty cache where it is missing or unreadable."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = None
    if not isinstance(cached, dict) or not isinstance(cached.get("shapes"), dict):
        if path.exists():
            logger.warning("Linear dispatch: ignoring the unreadable cache %s (it will be rewritten)", path)
        return {"host": host_key(), "shapes": {}}
    return cached
