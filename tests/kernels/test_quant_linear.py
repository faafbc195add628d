"""The quantized projection kernel (csrc/quant_linear_cpu.cpp) against references computed here:
an exact emulation of its arithmetic (each row's int8 activations per 32-block, exact block dot
products, the blocks combined in float64: the kernel within a few float32 roundings of it),
plain dequantize-then-matmul (within the worst case of the activations' rounding), a row alone
against the same row among 37 and under any thread count (bit for bit), the packed sizes, and bad
input refused with a readable error; the per-token mode (W8A8) against its exact product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.serves_quant_linear(4, 16, 32),
    reason="no quantized kernel in this CPU's build (it needs AVX2)",
)

EPS32 = torch.finfo(torch.float32).eps
MINS_KINDS = ["none", "q4_0", "free"]  # no mins (Q8_0); -8 * scale (Q4_0: folded); any (Q4_1, Q4_K)


def make_weight(bits: int, n: int, k: int, mins_kind: str, gen: torch.Generator):
    """q, scales, mins in the kernel's generic form; scales and mins float16 values, as GGUF's
    are (the pack keeps them exactly)."""
    low, high = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    mins = {
        "none": None,
        "q4_0": -8 * scales,
        "free": (torch.randn(n, k // 32, generator=gen) * 0.02).half().float(),
    }[mins_kind]
    return q, scales, mins


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of each row's 32-blocks, as specified: dx = max|x| / 127 in float32,
    quants round(x / dx) (ties to even; 0 where dx is 0). Returns quants [M, blocks, 32]
    (float64, whole numbers) and dx [M, blocks] float32."""
    blocks = x.float().view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1) / 127
    quants = torch.where(dx[..., None] == 0, 0.0, torch.round(blocks / dx[..., None]))
    return quants.double(), dx


def emulate(x, q, scales, mins, bias):
    """The kernel's sum per block, exactly: (scale * dx) * sum(q * xq) + min * (dx * sum(xq)),
    the products in float64 (dx * sum(xq) rounded to float32, as the kernel stores it). Returns
    the result [M, N] and the sum of its terms' magnitudes (the scale of a float32 rounding)."""
    quants, dx = quantize_activations(x)
    n, blocks = scales.shape
    dots = torch.einsum("mbk,nbk->mnb", quants, q.double().view(n, blocks, 32))
    terms = (dx[:, None, :].double() * scales[None].double()) * dots
    magnitude = terms.abs().sum(-1)
    result = terms.sum(-1)
    if mins is not None:
        dx_sums = (dx * quants.sum(-1).float()).double()  # [M, blocks]
        min_terms = mins[None].double() * dx_sums[:, None, :]
        result, magnitude = result + min_terms.sum(-1), magnitude + min_terms.abs().sum(-1)
    if bias is not None:
        result, magnitude = result + bias.double(), magnitude + bias.double().abs()
    return result, magnitude


def dequantized(q, scales, mins) -> torch.Tensor:
    """W [N, K] = scales * q + mins per 32-block, in float64."""
    w = q.double().view(q.shape[0], -1, 32) * scales.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    return w.view(q.shape)


def run(x, q, scales, mins, bits, bias=None):
    packed = cpu_ops.pack_quant_linear(q, scales, mins, bits)
    return cpu_ops.quant_linear(x, packed, bits, q.shape[0], q.shape[1], bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins_kind", MINS_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(112, 256), (100, 2048), (48, 8192)])
def test_quant_linear_equals_the_emulated_arithmetic(bits, mins_kind, dtype, n, k):
    """float32: within 4 float32 roundings of its terms' magnitudes (the kernel's sums of float32
    products, in its order, against exact ones); bfloat16 x: that, then one bfloat16 rounding.
    Groups of 64 columns cut short (112, 100: a panel of 16 cut short too, 48), 1 to 64 rows (the
    few-rows tiles and the others, tiles cut short, K taken a run of blocks at a time), K up to
    8,192; bias on odd M."""
    gen = torch.Generator().manual_seed(bits * 1000 + n + k)
    q, scales, mins = make_weight(bits, n, k, mins_kind, gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, bits)
    for rows in (1, 3, 8, 17, 64):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if rows % 2 else None
        got = cpu_ops.quant_linear(x, packed, bits, n, k, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        exact, magnitude = emulate(x, q, scales, mins, bias)
        tolerance = 4 * EPS32 * magnitude
        if dtype == torch.bfloat16:
            tolerance = tolerance * 1.01 + torch.finfo(dtype).eps / 2 * exact.abs()
        assert ((got.double() - exact).abs() <= tolerance).all(), f"rows {rows}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins_kind", MINS_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_is_the_dequantized_product_with_int8_activations(bits, mins_kind, dtype):
    """Against F.linear with W dequantized: each input is off by at most half its block's step
    (dx / 2) once quantized, so an output by at most sum_k |W[n, k]| * dx / 2 (plus float32's
    and bfloat16's roundings); over Gaussian rows the error is ~0.5% of the output's size."""
    gen = torch.Generator().manual_seed(bits + len(mins_kind))
    n, k, rows = 80, 1024, 9
    q, scales, mins = make_weight(bits, n, k, mins_kind, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = run(x, q, scales, mins, bits).double()
    w = dequantized(q, scales, mins)
    reference = F.linear(x.double(), w)
    _, dx = quantize_activations(x)
    step_bound = (w.abs().view(n, -1, 32).sum(-1)[None] * dx[:, None, :].double() / 2).sum(-1)
    _, magnitude = emulate(x, q, scales, mins, None)
    tolerance = step_bound + 4 * EPS32 * magnitude
    if dtype == torch.bfloat16:
        tolerance = tolerance * 1.01 + torch.finfo(dtype).eps / 2 * got.abs()
    assert ((got - reference).abs() <= tolerance).all()
    assert (got - reference).norm() <= 0.02 * reference.norm()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins_kind", ["none", "free"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_gives_a_row_the_same_bits_whatever_shares_the_call(bits, mins_kind, dtype):
    """Each row is quantized on its own and its outputs summed in one order: a row alone (the
    few-rows tiles, K in one run) equals the same row among 37 (the others, K in runs of blocks),
    under 1 thread or all, from a contiguous row or a strided view."""
    gen = torch.Generator().manual_seed(37 + bits)
    n, k = 100, 2048
    q, scales, mins = make_weight(bits, n, k, mins_kind, gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, bits)
    x = torch.randn(38, k, generator=gen).to(dtype)
    together = cpu_ops.quant_linear(x[1:], packed, bits, n, k, None)
    for i in (0, 5, 36):
        alone = cpu_ops.quant_linear(x[1 + i : 2 + i], packed, bits, n, k, None)
        assert torch.equal(alone, together[i : i + 1])
    strided = torch.randn(37, 2 * k, generator=gen).to(dtype)[:, ::2]
    assert torch.equal(
        cpu_ops.quant_linear(strided, packed, bits, n, k, None),
        cpu_ops.quant_linear(strided.contiguous(), packed, bits, n, k, None),
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_ops.quant_linear(x[1:], packed, bits, n, k, None), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_prompt_in_row_blocks_gives_each_row_the_bits_of_a_small_call(bits):
    """A prompt's rows go in blocks whose quantized activations stay in cache (K = 8,192: ~250
    rows a block, with enough column groups that the threads need no split by rows): across the
    blocks' edges every row equals itself computed in a call of a few rows."""
    gen = torch.Generator().manual_seed(600 + bits)
    n, k = 520, 8192
    q, scales, mins = make_weight(bits, n, k, "none", gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, bits)
    x = torch.randn(600, k, generator=gen).bfloat16()
    whole = cpu_ops.quant_linear(x, packed, bits, n, k, None)
    pieces = [cpu_ops.quant_linear(x[i : i + 8], packed, bits, n, k, None) for i in range(0, 600, 8)]
    assert torch.equal(whole, torch.cat(pieces))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(112, 256), (100, 2048), (48, 8192)])
def test_per_token_quant_linear_is_a_w8a8_product(dtype, n, k):
    """Per token (a W8A8 checkpoint's scheme): each row quantized with one dx = max|x| / 127, the
    byte products summed exactly over all of K, scaled once by scale * dx: within 4 float32
    roundings of the exact value (bfloat16 x: then one bfloat16 rounding); a row alone equals it
    among the others, under 1 thread or all."""
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    column_scales = (torch.rand(n, 1, generator=gen) * 0.02 + 1e-3).half().float()
    packed = cpu_ops.pack_quant_linear(
        q, column_scales.expand(n, k // 32).contiguous(), None, 8, per_token=True
    )
    for rows in (1, 3, 8, 17, 64):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if rows % 2 else None
        got = cpu_ops.quant_linear(x, packed, 8, n, k, bias)
        dx = x.float().abs().amax(1, keepdim=True) / 127
        quants = torch.round(x.float() / dx).double()
        terms = (quants @ q.double().T) * (dx.double() * column_scales.double().T)
        exact = terms + (0 if bias is None else bias.double())
        tolerance = 4 * EPS32 * (terms.abs() + (0 if bias is None else bias.double().abs()))
        if dtype == torch.bfloat16:
            tolerance = tolerance * 1.01 + torch.finfo(dtype).eps / 2 * exact.abs()
        assert ((got.double() - exact).abs() <= tolerance).all(), f"rows {rows}"
        for i in range(min(rows, 3)):
            assert torch.equal(cpu_ops.quant_linear(x[i : i + 1], packed, 8, n, k, bias), got[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_ops.quant_linear(x, packed, 8, n, k, bias), got)
    finally:
        torch.set_num_threads(threads)


def test_per_token_packing_refuses_weights_it_cannot_sum_over_k():
    gen = torch.Generator().manual_seed(7)
    q, scales, mins = make_weight(8, 32, 64, "free", gen)
    with pytest.raises(RuntimeError, match="8-bit weights with one scale per column"):
        cpu_ops.pack_quant_linear(q, scales, None, 8, per_token=True)  # a scale per block
    column = scales[:, :1].expand(32, 2).contiguous()
    with pytest.raises(RuntimeError, match="no mins"):
        cpu_ops.pack_quant_linear(q, column, mins, 8, per_token=True)
    q4, scales4, _ = make_weight(4, 32, 64, "none", gen)
    with pytest.raises(RuntimeError, match="8-bit"):
        cpu_ops.pack_quant_linear(q4, scales4[:, :1].expand(32, 2).contiguous(), None, 4, per_token=True)


@pytest.mark.parametrize(
    ("bits", "mins_kind", "bits_per_weight"),
    [(4, "q4_0", 4.5), (4, "none", 4.5), (4, "free", 5.0), (8, "none", 8.5), (8, "free", 9.0)],
)
def test_packed_bytes_per_weight(bits, mins_kind, bits_per_weight):
    """What a step streams: weights plus float16 scales (and mins where they are not a whole
    multiple of the scale), plus a 64-byte header; deterministic."""
    gen = torch.Generator().manual_seed(1)
    n, k = 256, 2048
    q, scales, mins = make_weight(bits, n, k, mins_kind, gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == 64 + n * k * bits_per_weight / 8
    assert torch.equal(packed, cpu_ops.pack_quant_linear(q.clone(), scales.clone(), mins, bits))


def test_scales_are_stored_in_float16():
    """Scales not float16 values (Q4_K's d * sc) are rounded to float16: the product is the
    emulation's with the float16 scales."""
    gen = torch.Generator().manual_seed(3)
    q, _, _ = make_weight(4, 48, 256, "none", gen)
    scales = torch.rand(48, 8, generator=gen) * 0.02 + 1e-3
    x = torch.randn(5, 256, generator=gen)
    exact, magnitude = emulate(x, q, scales.half().float(), None, None)
    assert ((run(x, q, scales, None, 4).double() - exact).abs() <= 4 * EPS32 * magnitude).all()


def test_how_far_ahead_the_weights_are_prefetched_never_changes_the_result():
    """stream_ahead (layers/linear_dispatch.py times it per host) moves the time alone."""
    gen = torch.Generator().manual_seed(8)
    q, scales, mins = make_weight(4, 200, 2048, "free", gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, 4)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 2048, generator=gen)
        results = [cpu_ops.quant_linear(x, packed, 4, 200, 2048, None, ahead) for ahead in (0, 256, 4096)]
        assert all(torch.equal(results[0], other) for other in results[1:])
    with pytest.raises(RuntimeError, match="stream_ahead must be"):
        cpu_ops.quant_linear(x, packed, 4, 200, 2048, None, -1)


def test_an_all_zero_row_gives_zeros_and_the_bias():
    q, scales, mins = make_weight(8, 32, 64, "free", torch.Generator().manual_seed(4))
    bias = torch.arange(32, dtype=torch.float32)
    out = run(torch.zeros(2, 64), q, scales, mins, 8, bias)
    assert torch.equal(out, bias.expand(2, 32))


def test_serves_quant_linear_names_the_shapes_it_takes():
    assert cpu_ops.serves_quant_linear(4, 100, 2048)
    assert cpu_ops.serves_quant_linear(8, 1, 32)
    assert not cpu_ops.serves_quant_linear(4, 100, 48)  # K % 32
    assert not cpu_ops.serves_quant_linear(5, 100, 64)
    assert not cpu_ops.serves_quant_linear(4, 0, 64)


def test_pack_quant_linear_refuses_bad_input():
    gen = torch.Generator().manual_seed(5)
    q, scales, mins = make_weight(4, 32, 64, "free", gen)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        cpu_ops.pack_quant_linear(q, scales, mins, 5)
    with pytest.raises(RuntimeError, match="int8"):
        cpu_ops.pack_quant_linear(q.float(), scales, mins, 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.pack_quant_linear(q[:, :48], scales[:, :1], None, 4)
    with pytest.raises(RuntimeError, match=r"scales and mins must be float32 \[N, K / 32\]"):
        cpu_ops.pack_quant_linear(q, scales[:, :1], mins, 4)
    with pytest.raises(RuntimeError, match=r"scales and mins must be float32"):
        cpu_ops.pack_quant_linear(q, scales, mins.double(), 4)
    with pytest.raises(RuntimeError, match=r"4-bit q must be 0\.\.15"):
        cpu_ops.pack_quant_linear(q - 1, scales, mins, 4)
    with pytest.raises(RuntimeError, match="float16's range"):
        cpu_ops.pack_quant_linear(q, scales * 1e7, mins, 4)


def test_quant_linear_refuses_bad_input():
    gen = torch.Generator().manual_seed(6)
    q, scales, mins = make_weight(4, 32, 64, "none", gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, 4)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"x must be float32 or bfloat16 \[M, K = 64\]"):
        cpu_ops.quant_linear(x.half(), packed, 4, 32, 64, None)
    with pytest.raises(RuntimeError, match=r"x must be float32 or bfloat16 \[M, K = 64\]"):
        cpu_ops.quant_linear(x[:, :32], packed, 4, 32, 64, None)
    with pytest.raises(RuntimeError, match="packed holds a 4-bit"):
        cpu_ops.quant_linear(x, packed, 8, 32, 64, None)
    with pytest.raises(RuntimeError, match="packed holds a 4-bit"):
        cpu_ops.quant_linear(torch.randn(2, 128), packed, 4, 32, 128, None)
    with pytest.raises(RuntimeError, match="what pack_quant_linear returned"):
        cpu_ops.quant_linear(x, torch.zeros(2048, dtype=torch.uint8), 4, 32, 64, None)
    with pytest.raises(RuntimeError, match="wrong size"):
        cpu_ops.quant_linear(x, packed[:-64], 4, 32, 64, None)
    with pytest.raises(RuntimeError, match=r"bias must be None or \[N = 32\] of x's dtype"):
        cpu_ops.quant_linear(x, packed, 4, 32, 64, torch.zeros(32, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[1] * 8, [3, 0, 1, 9, 2], [40, 1]], ids=["decode", "mixed", "prompt"])
def test_moe_quant_linear_gives_each_group_what_quant_linear_gives_it(dtype, counts):
    """A step's experts in one call: each group's rows exactly as a call of its own on its weight
    (bits and mins differ between the experts here; a group may have no rows)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 96, 128
    kinds = [(4, "q4_0"), (8, "none"), (4, "free"), (8, "free")]
    weights = []
    for g in range(len(counts)):
        bits, mins_kind = kinds[g % len(kinds)]
        q, scales, mins = make_weight(bits, n, k, mins_kind, gen)
        weights.append((bits, cpu_ops.pack_quant_linear(q, scales, mins, bits)))
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)
    offsets = F.pad(torch.tensor(counts).cumsum(0), (1, 0))
    grouped = cpu_ops.moe_quant_linear(x, [packed for _, packed in weights], offsets)
    for g, (bits, packed) in enumerate(weights):
        rows = x[offsets[g] : offsets[g + 1]]
        alone = cpu_ops.quant_linear(rows, packed, bits, n, k, None)
        assert torch.equal(grouped[offsets[g] : offsets[g + 1]], alone), g


def test_moe_quant_linear_refuses_bad_input():
    gen = torch.Generator().manual_seed(6)
    q, scales, mins = make_weight(4, 64, 64, "q4_0", gen)
    packed = cpu_ops.pack_quant_linear(q, scales, mins, 4)
    other = cpu_ops.pack_quant_linear(*make_weight(4, 128, 64, "q4_0", gen), 4)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        cpu_ops.moe_quant_linear(x, [packed], torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="offsets must be int64"):
        cpu_ops.moe_quant_linear(x, [packed, packed], torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="must not decrease"):
        cpu_ops.moe_quant_linear(x, [packed, packed, packed], torch.tensor([0, 2, 1, 3]))
    with pytest.raises(RuntimeError, match="weight 1 is"):
        cpu_ops.moe_quant_linear(x, [packed, other], torch.tensor([0, 1, 3]))
    with pytest.raises(RuntimeError, match="wrong size for its header"):
        cpu_ops.moe_quant_linear(x, [packed[:-1].contiguous()], torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="what pack_quant_linear returned"):
        cpu_ops.moe_quant_linear(x, [torch.zeros(64, dtype=torch.uint8)], torch.tensor([0, 3]))
