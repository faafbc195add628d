"""The CPU attention kernel against the PyTorch path it replaces (gather the blocks, SDPA): same
outputs for decodes and prefill chunks, every cache dtype, grouped-query layouts, ragged lengths
and scattered block tables; and each token's output bit for bit the same however a step is split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.attention.kv_quant import KV_CACHE_DTYPES, quantize
from pagedllm.attention.metadata import DecodeBatch, PrefillSpan
from pagedllm.attention.paged_attention import decode_gathered, prefill_gathered
from pagedllm.kernels import cpu_ops

CACHE_DTYPES = ["float32", "bfloat16", "float16", *KV_CACHE_DTYPES]
HALF_WIDTH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def test_the_kernel_builds_here():
    assert cpu_ops.is_built()  # CI machines have a compiler: a failed build must not pass silently


def test_the_loaded_build_keeps_its_name():
    """The name after loading is the loaded library's: callers look its folder up by it."""
    assert cpu_ops.is_built()
    assert cpu_ops._is_cached(cpu_ops.build_name())


def test_direct_calls_refuse_tensors_off_the_cpu():
    """The kernels called without torch.ops' dispatcher check the device themselves: a tensor
    elsewhere (meta here, CUDA on a GPU host) is refused with a clear error, never read."""
    off = torch.empty(2, 64, device="meta")
    with pytest.raises(RuntimeError, match="add_rms_norm: CPU tensors only"):
        cpu_ops.add_rms_norm(torch.zeros(2, 64), off, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul: CPU tensors only"):
        cpu_ops.silu_and_mul(off)
    with pytest.raises(RuntimeError, match="quant_linear: CPU tensors only"):
        cpu_ops.quant_linear(torch.zeros(1, 64), torch.zeros(64, dtype=torch.uint8), 4, 64, 64, off[0])


def test_the_kernels_through_the_dispatcher_answer_as_through_their_bindings():
    """Where the bindings cannot be compiled (no Python headers) the same kernels are called
    through torch.ops: every bound kernel is there by the same name, with the same answers."""
    assert cpu_ops.is_built()
    dispatched, direct = torch.ops.pagedllm, cpu_ops._ops()
    bound = [op for op in dir(direct) if not op.startswith("_")]
    assert "quant_linear" in bound and all(hasattr(dispatched, op) for op in bound)
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 3, 64, generator=gen).bfloat16()
    weight = torch.randn(64, generator=gen).bfloat16()
    for got, want in zip(
        dispatched.add_rms_norm(x, residual, weight, 1e-6),
        direct.add_rms_norm(x, residual, weight, 1e-6),
        strict=True,
    ):
        assert torch.equal(got, want)
    gate_up = torch.randn(3, 128, generator=gen)
    assert torch.equal(dispatched.silu_and_mul(gate_up), direct.silu_and_mul(gate_up))


def test_the_build_is_named_after_its_sources(tmp_path, monkeypatch, request):
    """Two trees with the same sources share one build; a tree whose sources differ (another
    checkout, another branch) gets its own, instead of rebuilding over the other's at each start."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(cpu_ops._CSRC, copy)
    here = cpu_ops.build_name()
    monkeypatch.setattr(cpu_ops, "_CSRC", copy)
    request.addfinalizer(cpu_ops._source_bytes.cache_clear)  # before monkeypatch puts _CSRC back
    cpu_ops._source_bytes.cache_clear()  # the sources are read once per process
    assert cpu_ops.build_name() == here
    (copy / "vec_math.h").write_text((copy / "vec_math.h").read_text() + "\n// another tree\n")
    cpu_ops._source_bytes.cache_clear()
    assert cpu_ops.build_name() != here


def _random_case(seed: int, cache_dtype: str, num_seqs: int, group: int, head_dim: int, block_size: int):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, num_blocks = 2, 64
    seq_lens = torch.randint(1, 6 * block_size, (num_seqs,), generator=gen)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    # each request owns distinct blocks in scattered order; padding entries point at block 0
    owned = torch.randperm(num_blocks - 1, generator=gen)[: num_seqs * max_blocks] + 1  # 6 blocks at most
    owned = owned.view(num_seqs, max_blocks)
    needed = -(-seq_lens // block_size)
    tables = torch.where(torch.arange(max_blocks)[None, :] < needed[:, None], owned, 0)
    k, v = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 3 for _ in "kv")
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen)
    if cache_dtype in HALF_WIDTH:  # a 16-bit model: queries and cache alike
        query, k, v = (x.to(HALF_WIDTH[cache_dtype]) for x in (query, k, v))
    elif cache_dtype != "float32":
        fmt = KV_CACHE_DTYPES[cache_dtype]
        k, v = quantize(k, fmt).view(fmt), quantize(v, fmt).view(fmt)
    mask = (torch.arange(max_blocks * block_size)[None, :] < seq_lens[:, None])[:, None, None, :]
    return query, k, v, DecodeBatch(torch.arange(num_seqs), tables, seq_lens, mask)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_seqs=st.integers(1, 9),
    group=st.sampled_from([1, 3, 4, 9]),  # 9: past the register-resident group sizes
    head_dim=st.sampled_from([8, 64, 128]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_kernel_equals_gather_and_sdpa(cache_dtype, seed, num_seqs, group, head_dim, block_size):
    query, k, v, batch = _random_case(seed, cache_dtype, num_seqs, group, head_dim, block_size)
    scale = head_dim**-0.5
    assert cpu_ops.serves(query.device, query.dtype, k.dtype, head_dim)
    got = cpu_ops.paged_decode_attention(query, k, v, batch.block_tables, batch.seq_lens, scale)
    if cache_dtype in HALF_WIDTH:
        # the kernel widens 16-bit rows and sums in float32: the float32 path on the same values,
        # rounded once to the query's dtype
        expected = decode_gathered(query.float(), k.float(), v.float(), batch, scale).to(query.dtype)
        assert got.dtype == query.dtype
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    else:
        expected = decode_gathered(query, k, v, batch, scale)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_reads_outside_the_cache_are_refused():
    query, k, v, batch = _random_case(0, "float32", num_seqs=2, group=3, head_dim=8, block_size=4)
    lens, tables = batch.seq_lens.clone(), batch.block_tables.clone()
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="past the block table"):
        cpu_ops.paged_decode_attention(query, k, v, tables, too_long, 0.1)
    tables[1, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="not a block"):
        cpu_ops.paged_decode_attention(query, k, v, tables, lens, 0.1)


def test_nan_in_a_score_reaches_the_output_as_sdpa_gives_it():
    query, k, v, batch = _random_case(1, "float32", num_seqs=2, group=3, head_dim=8, block_size=4)
    k[batch.block_tables[0, 0], 0, 1] = float("nan")  # request 0, token 0, KV head 1
    expected = decode_gathered(query, k, v, batch, 0.3)
    got = cpu_ops.paged_decode_attention(query, k, v, batch.block_tables, batch.seq_lens, 0.3)
    assert got[0, 3:].isnan().all() and expected[0, 3:].isnan().all()  # the heads reading KV head 1
    torch.testing.assert_close(got[0, :3], expected[0, :3])
    torch.testing.assert_close(got[1], expected[1])


def test_caches_of_different_dtypes_are_refused():
    query, k, v, batch = _random_case(2, "int8", num_seqs=1, group=1, head_dim=8, block_size=4)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ops.paged_decode_attention(query, k, v.view(torch.uint8), batch.block_tables, batch.seq_lens, 0.1)


def _prefill_case(
    seed: int, cache_dtype: str, rows: list[int], contexts: list[int], head_dim: int = 64, block_size: int = 4
):
    """Requests computing rows[i] tokens after contexts[i] cached ones, in scattered blocks.
    head_dim 64 takes the kernel's AVX-512 path where the CPU has one; 16 the AVX2 path."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, group, num_blocks = 2, 3, 96
    seq_lens = torch.tensor(rows) + torch.tensor(contexts)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = (torch.randperm(num_blocks, generator=gen)[: len(rows) * max_blocks]).view(len(rows), max_blocks)
    k, v = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 2 for _ in "kv")
    if cache_dtype != "float32":
        fmt = KV_CACHE_DTYPES[cache_dtype]
        k, v = quantize(k, fmt).view(fmt), quantize(v, fmt).view(fmt)
    query = torch.randn(sum(rows), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    return query, k, v, tables, starts, seq_lens


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_prefill_chunks_equal_causal_sdpa_over_the_gathered_context(cache_dtype, head_dim):
    rows, contexts = [1, 7, 33, 16, 2], [0, 0, 5, 40, 9]  # decodes, fresh prompts, chunks after a context
    query, k, v, tables, starts, seq_lens = _prefill_case(3, cache_dtype, rows, contexts, head_dim)
    got = cpu_ops.paged_attention(query, k, v, tables, starts, seq_lens, 0.25)
    for i, (n, context) in enumerate(zip(rows, contexts, strict=True)):
        visible = torch.arange(context + n)[None, :] <= torch.arange(context, context + n)[:, None]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        span = PrefillSpan(0, n, context, tables[i], mask)
        expected = prefill_gathered(query[starts[i] : starts[i + 1]], None, None, k, v, span, 0.25)
        torch.testing.assert_close(got[starts[i] : starts[i + 1]], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [1, 3, 4, 9, 16, 100])
def test_a_sliding_window_equals_sdpa_with_the_window_mask(cache_dtype, head_dim, window):
    """A sliding-window layer (Gemma 3's local layers): each query sees its last `window` keys,
    its own included. Decodes, fresh prompts and chunks after a context, against the PyTorch path's
    window mask; every token's output the same bits in one call, in two chunks and one by one."""
    assert cpu_ops.is_built()
    rows, contexts = [1, 7, 33, 16, 2, 1], [60, 0, 5, 40, 9, 3]
    source_dtype = "float32" if cache_dtype == "bfloat16" else cache_dtype
    query, k, v, tables, starts, seq_lens = _prefill_case(5, source_dtype, rows, contexts, head_dim)
    if cache_dtype == "bfloat16":
        query, k, v = query.bfloat16(), k.bfloat16(), v.bfloat16()
    got = cpu_ops.paged_attention(query, k, v, tables, starts, seq_lens, 0.25, window=window)
    for i, (n, context) in enumerate(zip(rows, contexts, strict=True)):
        span = PrefillSpan(0, n, context, tables[i], None)
        rows_i = slice(int(starts[i]), int(starts[i + 1]))
        if cache_dtype == "bfloat16":  # widened as read, summed in float32: the float32 path's result
            wide = (query[rows_i].float(), None, None, k.float(), v.float())
            expected, tolerance = prefill_gathered(*wide, span, 0.25, window), 2e-2
        else:
            expected = prefill_gathered(query[rows_i], None, None, k, v, span, 0.25, window)
            tolerance = 2e-5
        torch.testing.assert_close(got[rows_i].float(), expected, atol=tolerance, rtol=tolerance)
    # request 2 (33 tokens after 5): whole, split at 20, one token alone
    rows_2, table = query[starts[2] : starts[3]], tables[2:3]

    def run(first: int, last: int) -> torch.Tensor:
        return cpu_ops.paged_attention(
            rows_2[first:last],
            k,
            v,
            table,
            torch.tensor([0, last - first]),
            torch.tensor([5 + last]),
            0.25,
            window=window,
        )

    whole = run(0, 33)
    assert torch.equal(whole, got[starts[2] : starts[3]])
    assert torch.equal(torch.cat([run(0, 20), run(20, 33)]), whole)
    assert torch.equal(run(30, 31), whole[30:31])


@pytest.mark.parametrize("window", [3, 20, 1000])
def test_decodes_sharing_a_prefix_keep_their_own_window(window):
    """Shared prefix blocks read together (the decode tasks' grouping) while each request's window
    starts at its own length: together equals each alone, and the PyTorch path's window mask."""
    assert cpu_ops.is_built()
    gen = torch.Generator().manual_seed(8)
    num_kv_heads, group, head_dim, num_blocks, shared, block_size = 2, 3, 64, 200, 5, 4
    k, v = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in "kv")
    seq_lens = shared * block_size + torch.randint(1, 6 * block_size, (12,), generator=gen)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    own = torch.randperm(num_blocks - shared, generator=gen)[: 12 * max_blocks].view(12, max_blocks) + shared
    tables = torch.cat([torch.arange(shared).expand(12, shared), own[:, : max_blocks - shared]], dim=1)
    query = torch.randn(12, num_kv_heads * group, head_dim, generator=gen)
    starts = torch.arange(13)
    together = cpu_ops.paged_attention(query, k, v, tables, starts, seq_lens, 0.125, window=window)
    for i in range(12):
        alone = cpu_ops.paged_attention(
            query[i : i + 1], k, v, tables[i : i + 1], starts[:2], seq_lens[i : i + 1], 0.125, window=window
        )
        assert torch.equal(alone, together[i : i + 1])
    mask = (torch.arange(max_blocks * block_size)[None, :] < seq_lens[:, None])[:, None, None, :]
    batch = DecodeBatch(torch.arange(12), tables, seq_lens, mask)
    expected = decode_gathered(query, k, v, batch, 0.125, window)
    torch.testing.assert_close(together, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decodes_fewer_than_the_threads_are_cut_over_them_with_the_same_bits(
    cache_dtype, head_dim, block_size, window
):
    """One KV head (Gemma-3-1B's layout): one request's decode, or two sharing prefix blocks, is
    one task, so the kernel cuts its keys (scores) and its 64-value output ranges (weighted sums)
    over the threads, for every cache dtype. Each output is bit for bit what one thread computes,
    and what the request gets beside another request of its own; and it is the PyTorch path's,
    window included."""
    assert cpu_ops.is_built()
    gen = torch.Generator().manual_seed(head_dim + block_size)
    group, shared, max_blocks = 4, 3, -(-601 // block_size)
    num_blocks = 3 * max_blocks + shared
    k, v = (torch.randn(num_blocks, block_size, 1, head_dim, generator=gen) for _ in "kv")
    query = torch.randn(3, group, head_dim, generator=gen)
    if cache_dtype in HALF_WIDTH:
        query, k, v = (x.to(HALF_WIDTH[cache_dtype]) for x in (query, k, v))
    elif cache_dtype != "float32":  # 8-bit rows, their scale after the values
        fmt = KV_CACHE_DTYPES[cache_dtype]
        k, v = quantize(k, fmt).view(fmt), quantize(v, fmt).view(fmt)
    seq_lens = torch.tensor([601, 333, 90])
    own = torch.randperm(num_blocks - shared, generator=gen)[: 3 * max_blocks].view(3, max_blocks) + shared
    tables = torch.cat([torch.arange(shared).expand(3, shared), own[:, : max_blocks - shared]], dim=1)
    tables[2] = own[2]  # the third shares nothing with the first two

    def attend(rows: list[int], threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        starts = torch.arange(len(rows) + 1)
        return cpu_ops.paged_attention(
            query[rows], k, v, tables[rows], starts, seq_lens[rows], head_dim**-0.5, window=window
        )

    before = torch.get_num_threads()
    try:
        alone_cut, alone_whole = attend([0], 2), attend([0], 1)
        sharing_cut, sharing_whole = attend([0, 1], 2), attend([0, 1], 1)
        beside = attend([0, 2], 1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone_cut, alone_whole) and torch.equal(alone_cut, beside[:1])
    assert torch.equal(sharing_cut, sharing_whole) and torch.equal(sharing_cut[:1], alone_whole)
    mask = (torch.arange(max_blocks * block_size)[None, :] < seq_lens[:2, None])[:, None, None, :]
    batch = DecodeBatch(torch.arange(2), tables[:2], seq_lens[:2], mask)
    if cache_dtype in HALF_WIDTH:
        expected = decode_gathered(query[:2].float(), k.float(), v.float(), batch, head_dim**-0.5, window)
        torch.testing.assert_close(sharing_cut.float(), expected, atol=1e-2, rtol=1e-2)
    else:
        expected = decode_gathered(query[:2], k, v, batch, head_dim**-0.5, window)
        torch.testing.assert_close(sharing_cut, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cut=st.integers(1, 44), data=st.data())
def test_a_tokens_output_is_the_same_however_the_step_is_split(cache_dtype, head_dim, seed, cut, data):
    """45 tokens of one request: in one call, in two chunks split at `cut`, one by one, or beside
    other requests; every token's output is bit for bit the same."""
    source_dtype = "float32" if cache_dtype == "bfloat16" else cache_dtype
    query, k, v, tables, _, _ = _prefill_case(seed, source_dtype, [45], [0], head_dim)
    if cache_dtype == "bfloat16":
        query, k, v = query.bfloat16(), k.bfloat16(), v.bfloat16()
    table = tables[:1]

    def run(first: int, last: int) -> torch.Tensor:
        starts = torch.tensor([0, last - first])
        return cpu_ops.paged_attention(query[first:last], k, v, table, starts, torch.tensor([last]), 0.3)

    whole = run(0, 45)
    assert torch.equal(torch.cat([run(0, cut), run(cut, 45)]), whole)
    one_by_one = data.draw(st.sampled_from([0, 13, 44]))
    assert torch.equal(run(one_by_one, one_by_one + 1), whole[one_by_one : one_by_one + 1])
    # beside other requests (a decode and a fresh prompt sharing blocks 0.. of other tables)
    other_rows = query[:3]
    mixed_query = torch.cat([other_rows[:1], query[:45], other_rows])
    mixed_tables = torch.cat([tables[:1], table, tables[:1]])
    starts = torch.tensor([0, 1, 46, 49])
    mixed = cpu_ops.paged_attention(mixed_query, k, v, mixed_tables, starts, torch.tensor([20, 45, 3]), 0.3)
    assert torch.equal(mixed[1:46], whole)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
def test_requests_sharing_prefix_blocks_read_them_together_with_the_same_outputs(cache_dtype, block_size):
    """Decodes of 12 requests whose block tables start with the same blocks (a cached prefix),
    then diverge: all at once (the kernel reads shared blocks once per task) equals each alone,
    bit for bit, and equals gather + SDPA."""
    gen = torch.Generator().manual_seed(7)
    num_kv_heads, group, head_dim, num_blocks, shared = 2, 3, 64, 200, 5
    k, v = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in "kv")
    if cache_dtype == "bfloat16":
        k, v = k.bfloat16(), v.bfloat16()
    elif cache_dtype == "int8":
        k, v = (quantize(x, torch.int8).view(torch.int8) for x in (k, v))
    seq_lens = shared * block_size + torch.randint(1, 3 * block_size, (12,), generator=gen)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    own = torch.randperm(num_blocks - shared, generator=gen)[: 12 * max_blocks].view(12, max_blocks) + shared
    tables = torch.cat([torch.arange(shared).expand(12, shared), own[:, : max_blocks - shared]], dim=1)
    query = torch.randn(12, num_kv_heads * group, head_dim, generator=gen)
    if cache_dtype == "bfloat16":
        query = query.bfloat16()
    together = cpu_ops.paged_decode_attention(query, k, v, tables, seq_lens, 0.125)
    for i in range(12):
        alone = cpu_ops.paged_decode_attention(
            query[i : i + 1], k, v, tables[i : i + 1], seq_lens[i : i + 1], 0.125
        )
        assert torch.equal(alone, together[i : i + 1])
    mask = (torch.arange(max_blocks * block_size)[None, :] < seq_lens[:, None])[:, None, None, :]
    batch = DecodeBatch(torch.arange(12), tables, seq_lens, mask)
    if cache_dtype == "bfloat16":
        expected = decode_gathered(query.float(), k.float(), v.float(), batch, 0.125)
        torch.testing.assert_close(together.float(), expected, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(together, decode_gathered(query, k, v, batch, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_where_rows_are_prefetched_never_changes_the_output(cache_dtype, head_dim):
    """prefetch_to_l2 (timed per host, attention/row_prefetch.py) moves the time alone: decodes,
    fresh prompts and chunks after a context give the same bits either way."""
    assert cpu_ops.is_built()
    rows, contexts = [1, 7, 33, 16, 2], [60, 0, 5, 40, 9]
    source_dtype = "float32" if cache_dtype == "bfloat16" else cache_dtype
    query, k, v, tables, starts, seq_lens = _prefill_case(11, source_dtype, rows, contexts, head_dim)
    if cache_dtype == "bfloat16":
        query, k, v = query.bfloat16(), k.bfloat16(), v.bfloat16()
    into_l1, into_l2 = (
        cpu_ops.paged_attention(query, k, v, tables, starts, seq_lens, 0.25, to_l2) for to_l2 in (False, True)
    )
    assert torch.equal(into_l1, into_l2)


def test_row_prefetch_takes_the_way_whose_fastest_round_is_faster():
    from pagedllm.attention.row_prefetch import faster_is_l2, prefetch_to_l2

    assert faster_is_l2({False: [3.0, 1.0, 2.0], True: [0.9, 5.0, 5.0]})
    assert not faster_is_l2({False: [1.0, 9.0], True: [1.1, 1.2]})
    assert isinstance(prefetch_to_l2(torch.float32, torch.float32, 64), bool)  # timed once, then cached
    assert prefetch_to_l2.cache_info().currsize >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_the_pytorch_steps(dtype, with_residual):
    """Hugging Face's RMSNorm in PyTorch ops: the residual sum bit for bit, the output within one
    rounding of a 16-bit model dtype (only the order of summing squares differs); in float32,
    where no coarser rounding hides that order, within a few float32 roundings."""
    gen = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(37, 576, generator=gen).to(dtype) * 3 for _ in "xr")
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    summed = residual + x if with_residual else x
    h = summed.float()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert cpu_ops.serves_layer_ops(x.device, x.dtype)
    out, new_residual = cpu_ops.add_rms_norm(x, residual if with_residual else None, weight, 1e-5)
    assert torch.equal(new_residual, summed)
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp(min=1e-3)
    assert ((out.float() - expected.float()).abs() <= (4 if dtype == torch.float32 else 2) * ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 70])
def test_rms_norm_heads_in_place_equals_add_rms_norm_on_each_head(dtype, num_tokens):
    """Qwen3's and Gemma 3's q_norm and k_norm in one pass over the fused qkv: each head's row the
    same bits as add_rms_norm gives it, values untouched."""
    assert cpu_ops.is_built()
    gen = torch.Generator().manual_seed(num_tokens)
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q_weight, k_weight = (torch.rand(head_dim, generator=gen).to(dtype) + 0.5 for _ in "qk")
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    expected_q, _ = cpu_ops.add_rms_norm(q.reshape(-1, head_dim), None, q_weight, 1e-6)
    expected_k, _ = cpu_ops.add_rms_norm(k.reshape(-1, head_dim), None, k_weight, 1e-6)
    expected = torch.cat([expected_q.view(q.shape), expected_k.view(k.shape), v], dim=-1)
    got = cpu_ops.rms_norm_heads_(qkv, q_weight, k_weight, num_heads, num_kv_heads, 1e-6)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_write_kv_equals_apply_rotary_and_write_kv(dtype):
    """Bit for bit: the queries apply_rotary gives, and the rows write_kv writes."""
    from pagedllm.attention.backend import apply_rotary
    from pagedllm.attention.paged_attention import write_kv

    gen = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 6, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)  # half-negated, as the table holds it
    slots = torch.randperm(40, generator=gen)[:num_tokens]
    caches = [torch.zeros(10, 4, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    assert cpu_ops.serves_rotary_write_kv(qkv, caches[0])
    q = cpu_ops.rotary_write_kv(qkv, cos, sin, slots, caches[0], caches[1], num_heads, num_kv_heads)
    q_size = num_heads * head_dim
    qk = apply_rotary(qkv[:, : q_size + num_kv_heads * head_dim].view(num_tokens, -1, head_dim), cos, sin)
    v = qkv[:, q_size + num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    write_kv(caches[2], caches[3], qk[:, num_heads:], v, slots)
    assert torch.equal(q, qk[:, :num_heads])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_equals_the_pytorch_ops(dtype):
    """Hugging Face's act(gate) * up in the model dtype: within one rounding of it (the kernel's
    exp and sigmoid differ from PyTorch's in the last float32 bits, which rounding to a 16-bit
    dtype mostly hides; in float32 they show, a few roundings at most)."""
    assert cpu_ops.is_built()
    gen = torch.Generator().manual_seed(13)
    gate_up = (torch.randn(23, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # saturated and zero gates
    gate, up = gate_up.split(1536, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = cpu_ops.silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == expected.shape
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp(min=1e-3)
    if dtype == torch.float32:
        assert ((got - expected).abs() <= 4 * ulp).all()
    else:
        assert ((got.float() - expected.float()).abs() <= 2 * ulp).all()
        assert (got == expected).float().mean() > 0.99  # almost every value bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_tanh_and_mul_is_as_close_to_the_exact_value_as_the_pytorch_ops(dtype):
    """Gemma's gelu(gate, approximate="tanh") * up in the model dtype. The kernel computes
    x * sigmoid(2u) where PyTorch computes 0.5 x (1 + tanh(u)), which loses digits to cancellation
    for negative x: neither is the other's bits, so both are held to the exact value (float64, in
    the form without cancellation, rounded where Hugging Face rounds). Each of the kernel's values is
    as close as PyTorch's, within a rounding in a 16-bit dtype; in float32 within 16 (the argument's
    last-bit errors grow by |2u| through exp: 9 seen over 350,000 gates); saturated gates give x or
    0 as PyTorch's do."""
    assert cpu_ops.is_built()
    gen = torch.Generator().manual_seed(13)
    gate_up = (torch.randn(23, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -0.0, -20.0, 20.0])  # saturated and zero gates
    gate, up = gate_up.split(1536, dim=-1)
    x = gate.double()
    activated = (x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3))).to(dtype)
    exact = activated.double() * up.double()
    theirs = (torch.nn.functional.gelu(gate, approximate="tanh") * up).double()
    got = cpu_ops.gelu_tanh_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == up.shape
    rounding = torch.finfo(dtype).eps * exact.abs() * (16 if dtype == torch.float32 else 2)
    assert ((got.double() - exact).abs() <= (theirs - exact).abs() + rounding).all()
    assert torch.equal(got[0, :6], (torch.nn.functional.gelu(gate, approximate="tanh") * up)[0, :6])


@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 49157])
def test_argmax_equals_torch_argmax_with_ties_infinities_and_nan(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).round()  # rounded: many ties
    logits[1] = -float("inf")  # all equal: index 0
    logits[2, vocab // 2] = float("inf")
    logits[3, vocab - 1] = float("nan")
    logits[4, vocab // 3] = float("nan")
    logits[4, (2 * vocab) // 3] = float("nan")
    assert torch.equal(cpu_ops.argmax(logits), logits.argmax(dim=-1))
    half = logits[:, : max(1, vocab // 2)].contiguous()
    assert torch.equal(cpu_ops.argmax(half), half.argmax(dim=-1))


def _few_rows_available(dtype: torch.dtype) -> bool:
    name = str(dtype).removeprefix("torch.")
    return cpu_ops.is_built() and torch.ops.pagedllm.few_rows_linear_available(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(112, 576), (208, 64)])
def test_few_rows_linear_equals_the_exact_product_rounded_once(dtype, rows, with_bias, n, k):
    """x @ W.T + b against the product in float64: float32 within float32 summing error; bfloat16
    within one bfloat16 rounding of it (the kernel sums in float32, rounds once). 7, 13, 14 or 26
    panels (16 or 8 columns each): every grouping of panels the kernel makes, down to a lone
    panel, runs; so do rows past a tile's 8 (or 6)."""
    if not _few_rows_available(dtype):
        pytest.skip(f"this CPU build has no few-rows kernel for {dtype}")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    got = cpu_ops.few_rows_linear(x, cpu_ops.pack_few_rows(weight), bias)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=1e-2)
        assert ((got.double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_linear_gives_a_row_the_same_bits_whatever_rows_share_the_call(dtype):
    """Each output is its row's own sum in a fixed order: batching never changes a token's result
    (as with the attention kernel), from a lone row to a prompt of 37 (an odd bfloat16 offset too)."""
    if not _few_rows_available(dtype):
        pytest.skip(f"this CPU build has no few-rows kernel for {dtype}")
    gen = torch.Generator().manual_seed(7)
    packed = cpu_ops.pack_few_rows((torch.randn(112, 576, generator=gen) * 0.05).to(dtype))
    x = torch.randn(38, 576, generator=gen).to(dtype)
    together = cpu_ops.few_rows_linear(x[1:], packed, None)
    odd_offset = x.view(-1)[577 : 577 + 576].view(1, 576)  # starts one element into row 1
    for i in (0, 5, 36):
        assert torch.equal(cpu_ops.few_rows_linear(x[1 + i : 2 + i], packed, None), together[i : i + 1])
    assert torch.equal(
        cpu_ops.few_rows_linear(odd_offset, packed, None),
        cpu_ops.few_rows_linear(odd_offset.clone(), packed, None),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_in_row_blocks_gives_each_row_the_bits_of_a_small_call(dtype):
    """A prompt's rows go in blocks whose activations stay in cache (K = 8,192: 64-128 rows a
    block, with enough panel groups that the threads need no split by rows): across the blocks'
    edges every row equals itself computed in a call of a few rows."""
    if not _few_rows_available(dtype):
        pytest.skip(f"this CPU build has no few-rows kernel for {dtype}")
    gen = torch.Generator().manual_seed(8)
    packed = cpu_ops.pack_few_rows((torch.randn(512, 8192, generator=gen) * 0.01).to(dtype))
    x = torch.randn(300, 8192, generator=gen).to(dtype)
    pieces = [cpu_ops.few_rows_linear(x[i : i + 6], packed, None) for i in range(0, 300, 6)]
    assert torch.equal(cpu_ops.few_rows_linear(x, packed, None), torch.cat(pieces))


def test_few_rows_linear_rejects_a_weight_it_cannot_pack():
    if not cpu_ops.is_built():
        pytest.skip("no CPU kernel build")
    assert not cpu_ops.serves_few_rows_linear(torch.zeros(24, 64, dtype=torch.bfloat16))  # 24 % 16
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ops.pack_few_rows(torch.zeros(24, 64, dtype=torch.bfloat16))


def test_linear_packed_for_the_few_rows_kernel_answers_every_row_count():
    """Where the CPU serves bfloat16 through few_rows_linear, a Linear sent there packs its weight
    for it (the same bytes, no second copy) and answers decode-sized and prompt-sized batches
    alike, within one bfloat16 rounding of the exact product."""
    from pagedllm.layers.linear import Linear
    from pagedllm.layers.linear_dispatch import LinearDispatch

    layer = Linear(576, 960, bias=False).to(torch.bfloat16)
    if not cpu_ops.serves_few_rows_linear(layer.weight):
        pytest.skip("this CPU has no few-rows kernel for bfloat16")
    plain = layer.weight.detach().clone()
    layer.choose_impl(layer.weight.device, layer.weight.dtype, LinearDispatch("few_rows"))
    assert layer.impl is cpu_ops.few_rows_linear
    assert layer.weight.numel() * layer.weight.element_size() == plain.numel() * 2
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(200, 576, generator=gen).to(torch.bfloat16)
    exact = x.double() @ plain.double().T
    tolerance = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-2)
    for rows in (1, 4, 200):
        assert ((layer(x[:rows]).double() - exact[:rows]).abs() <= tolerance[:rows]).all()
