"""The kernels at each instruction-set level of cpu_types.h's ladder, as a host of that kind builds
them. The rest of the suite runs this host's own build (-march=native); here every level below
it that this CPU can run (plain loops, what a CPU without AVX2 gets; AVX2; AVX-512 without BF16)
is built with PAGEDLLM_CPU_MARCH and, in a pytest of its own, passes the kernel tests and the
dispatch's (a model's greedy tokens the same through every path the build has). At most
the two levels nearest below this host's: each costs a kernel build (~1 min on 2 cores), and the
hosts of the lower kinds run the rest. Levels above this CPU's cannot run here (SIGILL)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.cpu_features import cpu_flags
from pagedllm.kernels import cpu_ops

from ..helpers import AVX2_FLAGS, AVX512_FLAGS

REPO = Path(__file__).resolve().parents[2]
LEVELS = {  # -march: (the flags a CPU needs to run the build, cpu_types.h's ISA and VNNI levels in it)
    "x86-64": (frozenset(), (0, 0)),
    "x86-64-v3": (AVX2_FLAGS, (1, 0)),
    "x86-64-v4": (AVX512_FLAGS, (2, 0)),
}
FORCED_RUN = [  # what each forced build runs: the kernels against their references, the dispatch
    "tests/kernels",  # among the paths the build has, and a model's greedy tokens through
    "tests/layers/test_linear_dispatch.py",  # each of them
    "tests/test_host_kinds.py",
]


def native_levels(flags: frozenset[str]) -> tuple[int, int]:
    """What -march=native gives on a CPU with these flags, by cpu_types.h's rules."""
    if not {"avx2", "fma", "f16c"} <= flags:
        return 0, 0
    isa = 1
    if {"avx512f", "avx512bw", "avx512dq"} <= flags:
        isa = 3 if "avx512_bf16" in flags else 2
    vnni = 2 if isa >= 2 and "avx512_vnni" in flags else 1 if "avx_vnni" in flags else 0
    return isa, vnni


@pytest.mark.skipif(not cpu_ops.is_built(), reason="no compiler: the kernels are not built")
def test_the_kernels_are_built_for_the_level_asked():
    march = os.environ.get(cpu_ops.MARCH_VARIABLE)
    expected = LEVELS[march][1] if march else native_levels(cpu_flags())
    assert cpu_ops.instruction_set_levels() == expected
    assert cpu_ops.describe_build() == f"{cpu_ops.describe_levels(*expected)} (-march={march or 'native'})"


def test_a_bad_march_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(cpu_ops.MARCH_VARIABLE, "native -fplugin=x.so")
    with pytest.raises(
        ValueError, match=re.escape("PAGEDLLM_CPU_MARCH='native -fplugin=x.so' is not a compiler CPU name")
    ):
        cpu_ops.build_name()


@pytest.mark.slow  # a kernel build (~50 s on 2 cores) and the kernel tests per level
@pytest.mark.parametrize("march", list(LEVELS))
def test_a_build_for_a_lower_level_passes_the_kernel_and_dispatch_tests(march):
    if os.environ.get(cpu_ops.MARCH_VARIABLE):
        pytest.skip("inside a forced build's run")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 levels")
    needs, reports = LEVELS[march]
    flags = cpu_flags()
    if not needs <= flags:
        pytest.skip(f"this CPU cannot run {march} code (no {' '.join(sorted(needs - flags))})")
    below = native_levels(flags)[0] - reports[0]
    if below <= 0:
        pytest.skip(f"{march} is not below this host's level: the rest of the suite runs that")
    if below > 2:
        pytest.skip(f"{march} is more than two levels below this host's: a host of a lower kind runs it")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FORCED_RUN],
        cwd=REPO,
        env={**os.environ, cpu_ops.MARCH_VARIABLE: march},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
