"""What pagedllm decides from the CPU's flags, for each host kind users run, on whatever host the
tests run on: `--dtype auto`, whether oneDNN takes bfloat16, what the start-up line names, and the
paths a float projection may take where the kernels' build lacks a path (as a build for that kind
would: the few-rows kernel needs AVX512-BF16 for bfloat16, AVX2 for float32). The timed choice then
picks among those paths only, and the chosen one computes what the plain product computes. (The kernels' own
instruction-set choice is made at compile time, cpu_types.h; a build per kind is not run here.)"""

from __future__ import annotations

import pytest
import torch

from pagedllm import cpu_features
from pagedllm.kernels import cpu_ops
from pagedllm.layers import float_paths
from pagedllm.layers.linear_dispatch import FALLBACK, LinearDispatch, Timing
from pagedllm.model.locate import resolve_dtype

from .helpers import AVX2_FLAGS, AVX512_FLAGS

BF16 = AVX512_FLAGS | {"avx512_vnni", "avx512_bf16"}
HOST_KINDS = {  # flags (as /proc/cpuinfo spells them), and the fast dtype
    "zen3 (AVX2 only)": (AVX2_FLAGS, torch.float32),
    "skylake-sp (AVX-512, no VNNI)": (AVX512_FLAGS, torch.float32),
    "icelake-sp (AVX-512 VNNI)": (AVX512_FLAGS | {"avx512_vnni"}, torch.float32),
    "zen4 / zen5 (AVX-512 BF16)": (BF16, torch.bfloat16),
    "sapphire rapids (AMX)": (BF16 | {"amx_bf16", "amx_tile"}, torch.bfloat16),
    "arm (neoverse)": ({"fp", "asimd", "sve", "bf16"}, torch.float32),
    "no flags read": (set(), torch.float32),
}


def few_rows_first(weight, paths, rows) -> Timing:
    """A timer (no timing: this host's speeds are not the kind's) in which the few-rows kernel is
    the fastest path where it is one, oneDNN next."""
    seconds = {"few_rows": 1.0, "onednn": 2.0}
    return Timing({name: [seconds.get(name, 3.0)] * len(rows) for name in paths}, True)


@pytest.fixture(params=list(HOST_KINDS), ids=list(HOST_KINDS))
def host_kind(request, monkeypatch):
    flags, fast_dtype = HOST_KINDS[request.param]
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    return flags, fast_dtype


def test_auto_dtype_and_onednn_bfloat16_follow_the_flags(host_kind):
    _, fast_dtype = host_kind
    assert resolve_dtype("auto", torch.device("cpu")) == fast_dtype
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    if torch.backends.mkldnn.is_available():
        weight = torch.zeros(32, 64, dtype=torch.bfloat16)
        assert float_paths.can_pack_onednn(weight) == (fast_dtype == torch.bfloat16)
        assert float_paths.can_pack_onednn(weight.float())


def test_the_start_up_line_names_the_flags_that_decide(host_kind, monkeypatch):
    flags, _ = host_kind
    monkeypatch.setattr(cpu_features, "cpu_model_name", lambda: "Some CPU")
    described = cpu_features.describe_host.__wrapped__()
    named = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    assert described.startswith("Some CPU, ") and all(flag in described for flag in named)
    if not named:
        assert "none of avx2/avx512/amx" in described


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dispatch_chooses_among_the_paths_a_kinds_build_has(host_kind, dtype, monkeypatch, tmp_path):
    flags, _ = host_kind
    few_rows = "avx512_bf16" in flags if dtype == torch.bfloat16 else "avx2" in flags
    if few_rows and not cpu_ops.serves_few_rows_linear(torch.zeros(32, 64, dtype=dtype)):
        pytest.skip("this host's build has no few-rows kernel for the dtype to stand in for that kind's")
    monkeypatch.setattr(cpu_ops, "serves_few_rows_linear", lambda weight: few_rows)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    paths = float_paths.cpu_paths(weight)
    assert ("few_rows" in paths) == few_rows and list(paths)[-1] == FALLBACK
    chosen = LinearDispatch(cache_path=tmp_path / "dispatch.json", timer=few_rows_first).choose(weight, paths)
    assert chosen == next(name for name in ("few_rows", "onednn", FALLBACK) if name in paths)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = paths[chosen].run(x, paths[chosen].pack(weight), None)
    reference = torch.nn.functional.linear(x.double(), weight.double())
    assert torch.allclose(out.double(), reference, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)
