"""The prefix cache's disk tier and warm-up: a restart with the same directory starts warm and
gives a cold engine's greedy tokens; blocks evicted under pressure come back from disk; corrupted
or foreign files are refused; the size bound holds; the pool's invariants hold with the tier.

And the tier cannot stop or starve the engine (issue 21): schedule() touches no file; a directory
that turns read-only, a FIFO or a sparse 1 GiB file under a block's name, a full disk are misses
and warnings, against an in-process engine and a real server; bad flag values end start-up in one
line naming the flag and the path."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.block_hash import extend_hashes, get_hash_function
from pagedllm.core.disk_index import DiskIndex
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import KVTransfers
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.worker.kv_offload import DiskKVStore, KVOffloadMover

from ..helpers import (
    MECHANISM_MODEL,
    TEST_ENGINE_ARGS,
    RemoteServer,
    mechanism_server_args,
)

DOC = "A shared reference document about paged attention and block tables, line {}. "
PROMPT = "".join(DOC.format(i) for i in range(20)) + "Question: what is a block table?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
HEAD_DIM = MECHANISM_MODEL["hidden_size"] // MECHANISM_MODEL["num_attention_heads"]
KV_BYTES_PER_TOKEN = (
    2 * MECHANISM_MODEL["num_hidden_layers"] * MECHANISM_MODEL["num_key_value_heads"] * HEAD_DIM * 4
)
"""The mechanism model's float32 keys and values of one token."""


@pytest.fixture(scope="module")
def plain(mechanism_args) -> LLM:
    """The same model without a disk tier: the tokens to expect."""
    return LLM(**mechanism_args)


def engine(mechanism_args: dict, tmp_path, **overrides) -> LLM:
    return LLM(**{**mechanism_args, "kv_offload_dir": str(tmp_path / "kv"), **overrides})


def run(llm: LLM, prompt: str = PROMPT):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def disk_store(llm: LLM) -> DiskKVStore:
    """Rank 0's store: the files behind an engine's disk tier."""
    mover = llm.llm_engine.core.worker.kv_offload
    assert mover is not None
    return mover.store


@pytest.mark.slow
def test_a_restart_with_the_directory_starts_warm_and_equals_a_cold_engine(mechanism_args, tmp_path, plain):
    cold = run(plain)
    first = engine(mechanism_args, tmp_path)
    assert run(first).outputs[0].token_ids == cold.outputs[0].token_ids
    first.llm_engine.close()  # a graceful shutdown writes every cached block
    del first

    restarted = engine(mechanism_args, tmp_path)
    warm = run(restarted)
    full_blocks = (len(warm.prompt_token_ids) - 1) // 16
    assert warm.num_cached_tokens == full_blocks * 16 > 300
    assert restarted.llm_engine.core.kv_cache_manager.num_disk_hit_blocks == full_blocks
    assert restarted.llm_engine.get_stats().num_disk_hit_tokens == full_blocks * 16  # /metrics: source=disk
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.slow
def test_blocks_evicted_under_pressure_come_back_from_disk(mechanism_args, tmp_path, plain):
    small = engine(mechanism_args, tmp_path, num_gpu_blocks_override=80, max_model_len=512)
    expected = run(plain).outputs[0].token_ids
    run(small)
    for i in range(6):  # other prompts take every block: the first prompt's blocks are evicted
        run(small, "".join(f"Unrelated filler text number {i}, part {j}. " for j in range(30)))
    disk_store(small).flush()
    again = run(small)
    assert small.llm_engine.core.kv_cache_manager.num_disk_hit_blocks > 0
    assert again.num_cached_tokens > 300
    assert again.outputs[0].token_ids == expected
    small.llm_engine.core.kv_cache_manager.block_pool.check_integrity()


@pytest.mark.slow
def test_corrupted_and_foreign_files_are_refused(mechanism_args, tmp_path, plain, caplog):
    first = engine(mechanism_args, tmp_path)
    run(first)
    first.llm_engine.close()
    store_dir = disk_store(first).directory
    ids = plain.get_tokenizer()(PROMPT).input_ids
    first_block = store_dir / f"{extend_hashes([], ids, 16, get_hash_function('sha256'))[0].hex()}.kv"
    other = engine(mechanism_args, tmp_path, block_size=32)  # another fingerprint: its own subdirectory
    run(other)
    other.llm_engine.close()
    [foreign_dir] = [d for d in store_dir.parent.iterdir() if d != store_dir]
    foreign = next(foreign_dir.glob("*.kv")).read_bytes()
    del first, other
    expected = run(plain).outputs[0].token_ids

    data = bytearray(first_block.read_bytes())
    data[-1] ^= 0xFF  # a corrupted payload: the checksum says so
    for content in (bytes(data), foreign):  # then a file of another cache under the right name
        first_block.write_bytes(content)
        restarted = engine(mechanism_args, tmp_path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedllm.worker.kv_offload"):
            warm = run(restarted)
        assert "does not match this cache" in caplog.text
        assert warm.num_cached_tokens == 0  # the chain starts with the refused block
        assert warm.outputs[0].token_ids == expected
        assert not first_block.exists()  # refused files are deleted
        assert disk_store(restarted).num_refused == 1


@pytest.mark.slow  # writes the disk tier past its bound
def test_the_directory_stays_within_its_bound(mechanism_args, tmp_path):
    llm = engine(
        mechanism_args, tmp_path, kv_offload_max_bytes=3 * 16 * KV_BYTES_PER_TOKEN + 3 * 200
    )  # 3 blocks
    run(llm)
    llm.llm_engine.close()
    store = disk_store(llm)
    total = sum(f.stat().st_size for f in store.directory.glob("*.kv"))
    assert 0 < total <= store.max_bytes and store.num_blocks <= 3


@pytest.mark.slow  # an engine warmed from a file, restarted
def test_warm_up_file_makes_the_first_request_hit(mechanism_args, tmp_path):
    workload = tmp_path / "warm.jsonl"
    workload.write_text(json.dumps({"prompt": PROMPT, "max_tokens": 4}) + "\n")
    llm = LLM(**{**mechanism_args, "prefix_cache_warmup": str(workload)})
    first = run(llm)
    assert first.num_cached_tokens >= len(first.prompt_token_ids) - 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 90)), min_size=1, max_size=30))
def test_the_pool_stays_whole_with_a_disk_tier(ops):
    """Requests of a few shared prompt families come and go in a small pool: blocks move to the
    disk index and back (what was saved is staged before the next lookup, as if the disk held
    it); no block is owned twice, hashes stay consistent, all come home; each step's loads go
    into blocks that hold the loaded hash, once each."""
    disk = DiskIndex()
    manager = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, disk=disk)
    on_disk: set[bytes] = set()
    live: list[Request] = []
    for index, (family, length) in enumerate(ops):
        disk.set_staged(set(on_disk))
        request = Request(
            str(index), [family] * 3 + list(range(length % 40)), SamplingParams(), frozenset(), 8
        )
        manager.hash_prompt(request)
        blocks, hit = manager.get_computed_blocks(request)
        manager.block_pool.check_integrity()
        if manager.allocate_slots(request, request.num_tokens - hit, blocks) is None:
            for old in live:
                manager.free(old)
            live = []
        else:
            request.num_computed_tokens = request.num_tokens
            live.append(request)
        manager.block_pool.check_integrity()
        holders = Counter(b.block_id for r in live for b in manager.req_to_blocks[r.req_id])
        for block in manager.block_pool.blocks:  # each reference is one live request's
            assert block.ref_cnt == holders.get(block.block_id, 0), block
        transfers = manager.take_kv_transfers() or KVTransfers()
        on_disk.update(block_hash for _, block_hash in transfers.saves)
        for block_id, block_hash in transfers.loads:
            assert block_hash in on_disk
            assert manager.block_pool.blocks[block_id].block_hash == block_hash
    for request in live:
        manager.free(request)
    manager.block_pool.check_integrity()
    assert manager.block_pool.num_free_blocks == 12


# ---- issue 21: the disk tier cannot stop or starve the engine ------------------------------------

PROMPT_B = "".join(DOC.format(i) for i in range(100, 120)) + "Question: what is a slot mapping?"


def block_file(store_dir: Path, llm: LLM, prompt: str, index: int = 0) -> Path:
    ids = llm.get_tokenizer()(prompt).input_ids
    return store_dir / f"{extend_hashes([], ids, 16, get_hash_function('sha256'))[index].hex()}.kv"


@pytest.fixture(scope="module")
def populated(mechanism_args, tmp_path_factory) -> Path:
    """A --kv-offload-dir holding PROMPT's and PROMPT_B's blocks (copy it before changing it)."""
    root = tmp_path_factory.mktemp("populated")
    first = engine(mechanism_args, root)
    run(first)
    run(first, PROMPT_B)
    first.llm_engine.close()
    return root / "kv"


def copy_of(populated: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the --kv-offload-dir, its fingerprint subdirectory holding the files)."""
    shutil.copytree(populated, tmp_path / "kv")
    [store_dir] = (tmp_path / "kv").iterdir()
    return tmp_path / "kv", store_dir


def raise_erofs(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


@pytest.mark.slow
def test_a_directory_turned_read_only_is_misses_and_schedule_touches_no_file(
    mechanism_args, tmp_path, populated, plain, monkeypatch, caplog
):
    """The review's crash: os.utime (a hit), os.unlink (a refused file, an LRU victim) and the
    writes raise EROFS once the engine runs. Tokens stay a cold engine's; the tier turns
    read-only; and no file is touched inside schedule() by the engine thread."""
    _, store_dir = copy_of(populated, tmp_path)
    broken = block_file(store_dir, plain, PROMPT_B)
    data = bytearray(broken.read_bytes())
    data[-1] ^= 0xFF
    broken.write_bytes(bytes(data))
    expected = [run(plain, p).outputs[0].token_ids for p in (PROMPT, PROMPT_B)]
    small = engine(mechanism_args, tmp_path, num_gpu_blocks_override=80, max_model_len=512)

    in_schedule = threading.local()
    touched: list[str] = []
    schedule = Scheduler.schedule

    def watched_schedule(self):
        in_schedule.on = True
        try:
            return schedule(self)
        finally:
            in_schedule.on = False

    def watch(name, function):
        def watched(*args, **kwargs):
            if getattr(in_schedule, "on", False):
                touched.append(f"{name}{args[:1]}")
            return function(*args, **kwargs)

        return watched

    monkeypatch.setattr(Scheduler, "schedule", watched_schedule)
    for name in ("open", "lstat", "stat", "scandir", "readv", "read", "write"):
        monkeypatch.setattr(os, name, watch(name, getattr(os, name)))
    monkeypatch.setattr(io, "open", watch("io.open", io.open))
    for name in ("utime", "unlink", "replace"):
        monkeypatch.setattr(os, name, watch(name, raise_erofs))

    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.kv_offload"):
        warm = run(small)
        refused = run(small, PROMPT_B)
        for i in range(4):  # evictions: writes that fail
            run(small, "".join(f"Unrelated filler text number {i}, part {j}. " for j in range(30)))
        disk_store(small).flush()
    assert warm.num_cached_tokens > 300 and warm.outputs[0].token_ids == expected[0]
    assert refused.num_cached_tokens == 0 and refused.outputs[0].token_ids == expected[1]
    assert "cannot touch" in caplog.text and "cannot delete" in caplog.text
    assert "served read-only" in caplog.text and disk_store(small).read_only
    assert touched == []
    small.llm_engine.close()
    small.llm_engine.core.kv_cache_manager.block_pool.check_integrity()


def tiny_mover(directory: Path, max_staged_blocks: int = 8) -> KVOffloadMover:
    """A disk tier over a 4-block cache of one layer: no model needed."""
    caches = [tuple(torch.randn(4, 2, 3) for _ in range(2))]
    store = DiskKVStore(
        directory, 1 << 20, "ab" * 16, KVOffloadMover.payload_nbytes(caches), max_staged_blocks
    )
    return KVOffloadMover(store, caches)


HASHES = [bytes([i]) * 32 for i in range(4)]


def test_the_index_hands_over_a_steps_copies_in_order():
    """The scheduler side: a load needs a staged hash, once; a block evicted and then loaded into
    saves first; a block loaded and evicted within one step moves nothing."""
    index = DiskIndex()
    a, b, c = (bytes([i]) * 32 for i in range(3))
    index.set_staged({a, b})
    assert c not in index and not index.load(5, c)
    index.save(3, c)  # the pool evicts block 3 (hash c)...
    assert index.load(3, a)  # ...and gives it to a disk hit
    assert a not in index and not index.load(4, a)
    assert index.load(6, b)
    index.save(6, b)  # block 6, loaded this step, evicted again
    assert index.take_transfers() == KVTransfers(saves=[(3, c)], loads=[(3, a)])
    assert index.take_transfers() is None


def test_the_mover_saves_a_block_before_loading_into_it(tmp_path):
    """The worker side of the same step: block 0's bytes reach the disk, then block 0 holds the
    loaded block; a load of a block not staged is a bug, raised, never garbage computed on."""
    mover = tiny_mover(tmp_path)
    mover.start()
    mover.save(1, HASHES[1])
    assert mover.store.flush(30) and mover.stage([[HASHES[1]]]) == [HASHES[1]]
    old, loaded = ([t[i].clone() for t in mover.kv_caches[0]] for i in (0, 1))
    mover.apply(KVTransfers(saves=[(0, HASHES[0])], loads=[(0, HASHES[1])]))
    assert all(torch.equal(t[0], x) for t, x in zip(mover.kv_caches[0], loaded, strict=True))
    assert mover.store.flush(30) and mover.stage([[HASHES[0]]]) == [HASHES[0]]
    mover.apply(KVTransfers(loads=[(2, HASHES[0])]))
    assert all(torch.equal(t[2], x) for t, x in zip(mover.kv_caches[0], old, strict=True))
    with pytest.raises(RuntimeError, match="not staged"):
        mover.apply(KVTransfers(loads=[(2, HASHES[0])]))
    mover.store.close()


def test_fifo_sparse_file_link_and_directory_under_block_names_are_refused_at_once(tmp_path, caplog):
    mover = tiny_mover(tmp_path)
    store = mover.store
    mover.start()
    for block_id, block_hash in enumerate(HASHES):
        mover.save(block_id, block_hash)
    assert store.flush(30)
    paths = [store._path(h) for h in HASHES]
    for path in paths:
        path.unlink()
    os.mkfifo(paths[0])  # opened without O_NONBLOCK, a read waits for a writer forever
    with open(paths[1], "wb") as f:
        f.truncate(1 << 30)  # sparse: read whole, a GiB of memory
    paths[2].symlink_to("/dev/zero")
    paths[3].mkdir()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.kv_offload"):
        assert mover.stage([[h] for h in HASHES]) == []
    assert time.monotonic() - start < 30  # refused: a FIFO's read would wait for a writer forever
    assert not any(h in store for h in HASHES) and not any(mover.load(0, h) for h in HASHES)
    assert store.num_refused == 4 and store.num_blocks == 0
    assert "(not a regular file); deleted" in caplog.text
    assert caplog.text.count("does not match this cache") == 1  # a line a minute, not one a file
    assert not paths[0].exists() and not paths[1].exists() and not paths[2].is_symlink()
    store.close()


def test_a_full_disk_leaves_no_tmp_files_and_stale_ones_are_swept(tmp_path, monkeypatch, caplog):
    stale = tmp_path / ("ab" * 16) / f"{HASHES[0].hex()}.999.0.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"cut short")
    mover = tiny_mover(tmp_path)
    store = mover.store
    mover.start()
    assert not stale.exists()

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.kv_offload"):
        for block_id, block_hash in enumerate(HASHES):
            mover.save(block_id, block_hash)
        assert store.flush(30)
    assert list(stale.parent.iterdir()) == [] and store.num_blocks == 0 and not store.read_only
    assert caplog.text.count("it is not kept") == 1  # once, not once a block
    monkeypatch.undo()
    mover.save(0, HASHES[0])  # space again: written
    assert store.flush(30) and store.num_blocks == 1
    assert mover.stage([[HASHES[0]]]) == [HASHES[0]]
    mover.apply(KVTransfers(loads=[(3, HASHES[0])]))
    for cache in mover.kv_caches[0]:
        assert torch.equal(cache[3], cache[0])
    store.close()


def test_a_directory_that_cannot_be_written_is_served_read_only(tmp_path, monkeypatch, caplog):
    writable = tiny_mover(tmp_path)
    writable.start()
    writable.save(1, HASHES[1])
    assert writable.store.flush(30)
    writable.store.close()
    before = sorted(p.name for p in writable.directory.iterdir())

    open_file = os.open

    def no_writes(path, flags, *args):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise_erofs()
        return open_file(path, flags, *args)

    monkeypatch.setattr(os, "open", no_writes)
    for name in ("utime", "unlink", "replace"):
        monkeypatch.setattr(os, name, raise_erofs)
    mover = tiny_mover(tmp_path)
    store = mover.store
    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.kv_offload"):
        mover.start()
    assert store.read_only and "is not writable (Read-only file system): served read-only" in caplog.text
    mover.save(0, HASHES[0])  # nothing copied, nothing queued
    assert mover.stage([[HASHES[1]]]) == [HASHES[1]]
    assert mover.load(2, HASHES[1])
    assert mover.close([]) == (1, store.num_bytes)
    assert sorted(p.name for p in writable.directory.iterdir()) == before


def stop_promptly(server: RemoteServer) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        assert server.proc.wait(30) == 0, "".join(server.lines)
    finally:
        server.stop(signal.SIGKILL)


def peak_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def complete(url: str, prompt: str) -> dict:
    response = httpx.post(
        f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=60
    )
    response.raise_for_status()
    return response.json()


@pytest.mark.slow
def test_a_server_keeps_serving_past_a_fifo_and_a_sparse_gib_under_block_names(
    mechanism_model, tmp_path, populated, plain
):
    """Planted after start-up (so the index holds them): each request is a prompt miss, a
    bystander completes, memory does not grow by the GiB, SIGTERM exits at once."""
    root, store_dir = copy_of(populated, tmp_path)
    server = RemoteServer([*mechanism_server_args(mechanism_model), "--kv-offload-dir", str(root)])
    try:
        fifo, sparse = block_file(store_dir, plain, PROMPT), block_file(store_dir, plain, PROMPT_B)
        fifo.unlink()
        os.mkfifo(fifo)
        with open(sparse, "r+b") as f:
            f.truncate(1 << 30)
        peak = peak_rss_bytes(server.proc.pid)
        for prompt in (PROMPT, PROMPT_B, "A bystander asks: what is paged attention?"):
            assert complete(server.url, prompt)["usage"]["completion_tokens"] == 8
        assert peak_rss_bytes(server.proc.pid) - peak < 256 * 2**20
        log = "".join(server.lines)
        assert "does not match this cache (not a regular file); deleted" in log
        assert not fifo.exists() and not sparse.exists()
    finally:
        stop_promptly(server)


RO_SERVER = """
import ctypes, subprocess, sys
directory = sys.argv.pop(1)
if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS: mounts of our own
    sys.exit("unshare failed")
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "--bind", directory, directory], check=True)
subprocess.run(["mount", "-o", "remount,ro,bind", directory], check=True)
from pagedllm.entrypoints.openai.api_server import main
main()
"""


@pytest.mark.slow
def test_a_server_on_a_read_only_mount_serves_hits_from_it(mechanism_model, tmp_path, populated, plain):
    """A real read-only mount (a private mount namespace): the review's EROFS from os.utime and
    os.unlink, for real. Hits come from the files, a corrupted one is ignored, nothing changes."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespaces here (needs CAP_SYS_ADMIN)")
    root, store_dir = copy_of(populated, tmp_path)
    broken = block_file(store_dir, plain, PROMPT_B)
    data = bytearray(broken.read_bytes())
    data[-1] ^= 0xFF
    broken.write_bytes(bytes(data))
    before = {p.name: p.stat().st_mtime_ns for p in store_dir.iterdir()}
    (tmp_path / "ro_server.py").write_text(RO_SERVER)
    server = RemoteServer(
        [str(root), *mechanism_server_args(mechanism_model), "--kv-offload-dir", str(root)],
        module="ro_server",
        env={"PYTHONPATH": str(tmp_path)},
    )
    try:
        assert "served read-only" in "".join(server.lines)
        hit = complete(server.url, PROMPT)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        assert complete(server.url, PROMPT_B)["usage"]["completion_tokens"] == 8
        assert "does not match this cache (fingerprint, size or checksum); ignored" in "".join(server.lines)
    finally:
        stop_promptly(server)
    assert {p.name: p.stat().st_mtime_ns for p in store_dir.iterdir()} == before


def start_up_error(tmp_path: Path, mechanism_model: str, *args: str) -> str:
    """The api_server's output when it refuses to start."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.openai.api_server",
            *mechanism_server_args(mechanism_model),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_bad_offload_and_warm_up_values_end_start_up_in_one_line(mechanism_model, tmp_path):
    """What the config can tell (a file where a directory goes, a missing or special warm-up file)
    it refuses before any model loads: checked in process, as the message the server prints after
    "error: ". What shows only at start-up (a directory that cannot be made, a warm-up file that does
    not parse) ends a real server's start in that one line, no traceback."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    bad_json = tmp_path / "warm.jsonl"
    bad_json.write_text('{"prompt": "x", "max_tokens": 1}\n{not json\n')
    os.mkfifo(tmp_path / "fifo")

    def config_error(**settings) -> str:
        with pytest.raises(ValueError) as refused:
            EngineConfig(**(TEST_ENGINE_ARGS | settings))
        return f"error: {refused.value}"

    assert config_error(kv_offload_dir=str(a_file)) == (
        f"error: kv_offload_dir: {a_file} is not a directory; point --kv-offload-dir at one "
        "(created if missing)"
    )
    for path, why in (
        (tmp_path / "missing.jsonl", "no such file"),
        (tmp_path / "fifo", "not a regular file"),
    ):
        assert config_error(prefix_cache_warmup=str(path)) == (
            f"error: prefix_cache_warmup: {path}: {why}; give --prefix-cache-warmup a JSONL file of "
            "prompts or conversations"
        )
    line = start_up_error(tmp_path, mechanism_model, "--kv-offload-dir", str(a_file / "kv"))
    assert line.startswith(f"error: kv_offload_dir: cannot create {a_file / 'kv'} (")
    assert "--kv-offload-dir" in line
    line = start_up_error(tmp_path, mechanism_model, "--prefix-cache-warmup", str(bad_json))
    assert line.startswith(f"error: prefix_cache_warmup: cannot read {bad_json} (")
    assert "--prefix-cache-warmup" in line
