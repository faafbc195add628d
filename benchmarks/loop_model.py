"""The decode kernels' inner loops on cores this host is not: compiled for each host kind's
-march and run through llvm-mca's model of that core (Debian's `llvm` package).

    .venv/bin/python benchmarks/loop_model.py
    .venv/bin/python benchmarks/loop_model.py --targets znver3 icelake-server --rows 1 2

The loops are the ones a 1-row decode step spends its time in: quant_linear's block loop (one
32-input block of P panels of 16 columns: 4-bit Q4_0-like without mins, Q4_1 / Q4_K-like with, and
8-bit) and few_rows_linear's step loop (bfloat16 pairs, float32), each marked in the source
(PAGEDLLM_MCA_BEGIN / _END in csrc/, empty in every real build). Each source is compiled as the
kernels are (-O3 -march=<kind> -fno-trapping-math) with -DPAGEDLLM_MCA -S, and llvm-mca prints
the loop's steady-state cycles per iteration on that core. The table gives, per loop and core,
those cycles and the bytes of weights one iteration reads, so bytes per cycle: a decode step
waits on memory, not on these loops, where a core's share of the host's bandwidth is below that
(2 vCPUs streaming 25-30 GB/s at ~3.5 GHz: ~4 bytes a cycle each). These are predictions of a
model of each core, not measurements; LLVM 14's llvm-mca has no Zen 4 or Zen 5 model (Zen 3's
is the nearest, without AVX-512), so those hosts' loops are measured only
(benchmarks/quant_linear.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "pagedllm" / "kernels" / "csrc"
SOURCES = ["quant_linear_cpu.cpp", "few_rows_linear_cpu.cpp"]

TARGETS = {  # host kind -> (gcc -march, llvm-mca -mcpu)
    "znver1": ("znver1", "znver1"),  # host D: AVX2 + FMA on 128-bit units, no AVX-512, no VNNI
    "znver3": ("znver3", "znver3"),  # host A: AVX2 + FMA, no AVX-512, no VNNI
    "skylake-avx512": ("skylake-avx512", "skylake-avx512"),  # AVX-512 without VNNI
    "icelake-server": ("icelake-server", "icelake-server"),  # AVX-512 + VNNI, no BF16
    "sapphirerapids": ("sapphirerapids", "sapphirerapids"),  # AVX-512 + VNNI + BF16 (+ AMX)
}


@dataclass
class Loop:
    name: str
    cycles: float  # per iteration, steady state
    bytes: int  # of weights read per iteration


def weight_bytes(name: str) -> int | None:
    """Bytes of weights one iteration of a marked loop reads, from its name; None for loops a
    1-row decode does not run."""
    first, second, _rows, panels = map(int, name.split("_")[-4:])
    if "quant_linear" in name:  # first: bits; second: 0 no mins, 1 mins, 2 per token
        if second == 2:
            return None
        return panels * (64 * first + 16 * 2 * (2 if second == 1 else 1))
    # few_rows: first 32 (float32, second = lanes) or 16 (bfloat16 pairs, 16 lanes of 4 bytes)
    return panels * second * 4


def compile_to_assembly(source: Path, march: str, out: Path) -> None:
    import torch.utils.cpp_extension as ext

    includes = [*ext.include_paths(), sysconfig.get_paths()["include"]]
    command = ["c++", "-std=c++20", "-O3", f"-march={march}", "-fno-trapping-math", "-fopenmp", "-fPIC"]
    command += ["-DPAGEDLLM_MCA", "-DTORCH_API_INCLUDE_EXTENSION_H", "-S", "-o", str(out), str(source)]
    command += [flag for path in includes for flag in ("-isystem", path)] + [f"-I{CSRC}"]
    subprocess.run(command, check=True)


def balanced(text: str) -> str:
    """The assembly with each marked region begun and ended once: the compiler may copy a loop's
    end (a peeled or versioned tail), leaving END markers of regions already ended, and copy a
    whole loop (a second BEGIN of a name): the first copy is the one modelled."""
    lines, active, seen = [], set(), set()
    for line in text.splitlines():
        marker = re.match(r"\s*# LLVM-MCA-(BEGIN|END) (\S+)", line)
        if marker is None:
            lines.append(line)
            continue
        kind, name = marker.groups()
        if kind == "BEGIN" and name not in seen:
            active.add(name)
            seen.add(name)
            lines.append(line)
        elif kind == "END" and name in active:
            active.remove(name)
            lines.append(line)
    return "\n".join(lines) + "\n"


def model_loops(assembly: Path, mcpu: str) -> list[Loop]:
    assembly.write_text(balanced(assembly.read_text()))
    done = subprocess.run(
        ["llvm-mca", f"-mcpu={mcpu}", "-iterations=200", str(assembly)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 and "Code Region" not in done.stdout:
        raise RuntimeError(f"llvm-mca -mcpu={mcpu}: {done.stderr.strip()[:400]}")
    loops = []
    for region in re.split(r"\n\[\d+\] Code Region - ", "\n" + done.stdout)[1:]:
        name = region.split("\n", 1)[0].strip()
        iterations = int(re.search(r"Iterations:\s+(\d+)", region).group(1))
        total = int(re.search(r"Total Cycles:\s+(\d+)", region).group(1))
        size = weight_bytes(name)
        if size is not None:
            loops.append(Loop(name, total / iterations, size))
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="tile rows to show (default: 1)")
    args = parser.parse_args()
    header = f"{'core':16} {'loop (kind_rows_panels)':34} {'cycles/iter':>11} {'bytes/iter':>10}"
    print(f"{header} {'bytes/cycle':>11}")
    with tempfile.TemporaryDirectory() as folder:
        for target in args.targets:
            march, mcpu = TARGETS[target]
            for source in SOURCES:
                assembly = Path(folder) / f"{source}.{target}.s"
                compile_to_assembly(CSRC / source, march, assembly)
                for loop in model_loops(assembly, mcpu):
                    if int(loop.name.split("_")[-2]) not in args.rows:
                        continue
                    print(
                        f"{target:16} {loop.name:34} {loop.cycles:11.1f} {loop.bytes:10d} "
                        f"{loop.bytes / loop.cycles:11.1f}"
                    )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
