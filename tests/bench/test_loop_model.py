"""benchmarks/loop_model.py's handling of the compiler's assembly (llvm-mca itself is not run:
CI hosts need not have it): a region whose end the compiler copied, or whose loop it copied whole,
is modelled once; a loop's name gives the bytes of weights one iteration reads."""

from __future__ import annotations

from ..helpers import benchmark_module

loop_model = benchmark_module("loop_model.py")


def test_each_region_is_begun_and_ended_once():
    text = "\n".join(
        [
            "\t# LLVM-MCA-END quant_linear_4_0_1_4",  # an END before its BEGIN: ignored
            "\t# LLVM-MCA-BEGIN quant_linear_4_0_1_4",
            "\tvpdpbusd %zmm1, %zmm2, %zmm3",
            "\t# LLVM-MCA-END quant_linear_4_0_1_4",
            "\t# LLVM-MCA-END quant_linear_4_0_1_4",  # a peeled tail's copy
            "\t# LLVM-MCA-BEGIN quant_linear_4_0_1_4",  # the loop copied whole
            "\tvpdpbusd %zmm1, %zmm2, %zmm4",
            "\t# LLVM-MCA-END quant_linear_4_0_1_4",
        ]
    )
    kept = loop_model.balanced(text).splitlines()
    assert [line.split()[1] for line in kept if "LLVM-MCA" in line] == ["LLVM-MCA-BEGIN", "LLVM-MCA-END"]
    assert sum("vpdpbusd" in line for line in kept) == 2


def test_a_loops_name_gives_the_bytes_it_reads():
    assert loop_model.weight_bytes("quant_linear_4_0_1_4") == 4 * (64 * 4 + 32)  # codes, float16 scales
    assert loop_model.weight_bytes("quant_linear_4_1_1_4") == 4 * (64 * 4 + 64)  # and mins
    assert loop_model.weight_bytes("quant_linear_8_2_1_4") is None  # per token: not a decode's
    assert loop_model.weight_bytes("few_rows_32_8_1_3") == 3 * 8 * 4
