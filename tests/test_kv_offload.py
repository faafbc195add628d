"""The prefix cache's disk tier and warm-up: a restart with the same directory starts warm and
gives a cold engine's greedy tokens; blocks evicted under pressure come back from disk; corrupted
or foreign files are refused; the size bound holds; the pool's invariants hold with the tier."""

from __future__ import annotations

import json
import logging
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import extend_hashes, get_hash_function
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request

from .conftest import TEST_ENGINE_ARGS

DOC = "A shared reference document about paged attention and block tables, line {}. "
PROMPT = "".join(DOC.format(i) for i in range(20)) + "Question: what is a block table?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def engine(tmp_path, **overrides) -> LLM:
    return LLM(**{**TEST_ENGINE_ARGS, "kv_offload_dir": str(tmp_path / "kv"), **overrides})


def run(llm: LLM, prompt: str = PROMPT):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def test_a_restart_with_the_directory_starts_warm_and_equals_a_cold_engine(tmp_path, llm):
    cold = run(llm)
    first = engine(tmp_path)
    assert run(first).outputs[0].token_ids == cold.outputs[0].token_ids
    first.llm_engine.close()  # a graceful shutdown writes every cached block
    del first

    restarted = engine(tmp_path)
    warm = run(restarted)
    full_blocks = (len(warm.prompt_token_ids) - 1) // 16
    assert warm.num_cached_tokens == full_blocks * 16 > 300
    assert restarted.llm_engine.kv_cache_manager.num_disk_hit_blocks == full_blocks
    assert restarted.llm_engine.get_stats().num_disk_hit_tokens == full_blocks * 16  # /metrics: source=disk
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_blocks_evicted_under_pressure_come_back_from_disk(tmp_path, llm):
    small = engine(tmp_path, num_gpu_blocks_override=80, max_model_len=512)
    expected = run(llm).outputs[0].token_ids
    run(small)
    for i in range(6):  # other prompts take every block: the first prompt's blocks are evicted
        run(small, "".join(f"Unrelated filler text number {i}, part {j}. " for j in range(30)))
    small.llm_engine.kv_offload.flush()
    again = run(small)
    assert small.llm_engine.kv_cache_manager.num_disk_hit_blocks > 0
    assert again.num_cached_tokens > 300
    assert again.outputs[0].token_ids == expected
    small.llm_engine.kv_cache_manager.block_pool.check_integrity()


def test_corrupted_and_foreign_files_are_refused(tmp_path, llm, caplog):
    first = engine(tmp_path)
    run(first)
    first.llm_engine.close()
    store_dir = first.llm_engine.kv_offload.directory
    ids = llm.get_tokenizer()(PROMPT).input_ids
    first_block = store_dir / f"{extend_hashes([], ids, 16, get_hash_function('sha256'))[0].hex()}.kv"
    other = engine(tmp_path, block_size=32)  # another fingerprint: its own subdirectory
    run(other)
    other.llm_engine.close()
    [foreign_dir] = [d for d in store_dir.parent.iterdir() if d != store_dir]
    foreign = next(foreign_dir.glob("*.kv")).read_bytes()
    del first, other
    expected = run(llm).outputs[0].token_ids

    data = bytearray(first_block.read_bytes())
    data[-1] ^= 0xFF  # a corrupted payload: the checksum says so
    for content in (bytes(data), foreign):  # then a file of another cache under the right name
        first_block.write_bytes(content)
        restarted = engine(tmp_path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedllm.worker.kv_offload"):
            warm = run(restarted)
        assert "does not match this cache" in caplog.text
        assert warm.num_cached_tokens == 0  # the chain starts with the refused block
        assert warm.outputs[0].token_ids == expected
        assert not first_block.exists()  # refused files are deleted
        assert restarted.llm_engine.kv_offload.num_refused == 1


def test_the_directory_stays_within_its_bound(tmp_path):
    llm = engine(tmp_path, kv_offload_max_bytes=3 * 16 * 46_080 + 3 * 200)  # three float32 blocks
    run(llm)
    llm.llm_engine.close()
    store = llm.llm_engine.kv_offload
    total = sum(f.stat().st_size for f in store.directory.glob("*.kv"))
    assert 0 < total <= store.max_bytes and store.num_blocks <= 3


def test_warm_up_file_makes_the_first_request_hit(tmp_path):
    workload = tmp_path / "warm.jsonl"
    workload.write_text(json.dumps({"prompt": PROMPT, "max_tokens": 4}) + "\n")
    llm = LLM(**{**TEST_ENGINE_ARGS, "prefix_cache_warmup": str(workload)})
    first = run(llm)
    assert first.num_cached_tokens >= len(first.prompt_token_ids) - 16


class FakeDisk:
    """The disk tier's contract, in memory: what was saved can be loaded."""

    def __init__(self) -> None:
        self.saved: dict[bytes, int] = {}

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.saved

    def save(self, block_id: int, block_hash: bytes) -> None:
        self.saved[block_hash] = block_id

    def load(self, block_id: int, block_hash: bytes) -> bool:
        return block_hash in self.saved


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 90)), min_size=1, max_size=30))
def test_the_pool_stays_whole_with_a_disk_tier(ops):
    """Requests of a few shared prompt families come and go in a small pool: blocks move to the
    fake disk and back; no block is owned twice, hashes stay consistent, all come home."""
    manager = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, disk=FakeDisk())
    live: list[Request] = []
    for index, (family, length) in enumerate(ops):
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
    for request in live:
        manager.free(request)
    manager.block_pool.check_integrity()
    assert manager.block_pool.num_free_blocks == 12
