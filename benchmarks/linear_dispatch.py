"""The measured dispatch of float projections (issue 25) against each path alone, in one run.

    .venv/bin/python benchmarks/linear_dispatch.py                   # bfloat16 and float32
    .venv/bin/python benchmarks/linear_dispatch.py --dtype float32

SmolLM2-135M's projections as few_rows_linear.py builds them (30 layers of qkv, o, gate_up and
down, each layer its own weights, so a pass streams them from memory as a step does; and the
49,152-row tied lm_head), packed three ways: for the few-rows kernel, for oneDNN, and as the
engine's dispatch chooses (timed afresh here, in a temporary cache dir, as at a first start).
For each row count, milliseconds for all 30 layers' products and for one lm_head product (least
of several passes, the three ways taking turns), and the dispatched time over the faster single
path's there. A weight takes one path at every row count (a row's result must not depend on its
batch), so a row count where the other path wins shows what that costs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pagedllm.bench.throughput import git_sha
from pagedllm.cpu_features import describe_host
from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import Linear
from pagedllm.layers.linear_dispatch import ROW_COUNTS, LinearDispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from few_rows_linear import HIDDEN, LAYER_SHAPES, smollm2_weights

WAYS = ("few_rows", "onednn", "dispatched")


def build(dtype: torch.dtype, plain: list[torch.Tensor], dispatch: LinearDispatch) -> list[Linear]:
    layers = []
    for weight in plain:
        layer = Linear(weight.shape[1], weight.shape[0]).to(dtype)
        layer.weight.data.copy_(weight)
        layer.choose_impl(torch.device("cpu"), dtype, dispatch)
        layers.append(layer)
    return layers


def run_layers(layers: list[Linear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer(inputs[layer.in_features])


def least_seconds(passes: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Least seconds of one pass of each, the passes taking turns."""
    best = dict.fromkeys(passes, float("inf"))
    for _ in range(repeats + 1):  # the first round warms up (oneDNN builds its kernels)
        for name, run in passes.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run_dtype(dtype: torch.dtype, rows_list: list[int]) -> None:
    plain, head = smollm2_weights(dtype)
    gen = torch.Generator().manual_seed(1)  # the inputs
    with tempfile.TemporaryDirectory() as cache:
        dispatched = LinearDispatch("auto", cache_path=Path(cache) / "d.json")
        ways = {
            "few_rows": LinearDispatch("few_rows"),
            "onednn": LinearDispatch("onednn"),
            "dispatched": dispatched,
        }
        built = {name: (build(dtype, plain, d), build(dtype, [head], d)[0]) for name, d in ways.items()}
    print(f"\n{dispatched.summary()}\n")
    print(
        f"host: {describe_host()}; dtype {str(dtype)[6:]}; {torch.get_num_threads()} threads; git {git_sha()}"
    )
    print(
        "| rows | 30 layers: few_rows ms | oneDNN ms | dispatched ms | dispatched / best "
        "| lm_head: few_rows ms | oneDNN ms | dispatched ms | dispatched / best |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in LAYER_SHAPES}
            head_input = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
            repeats = max(3, 64 // rows)

            layer_times = least_seconds(
                {name: partial(run_layers, layers, inputs) for name, (layers, _) in built.items()}, repeats
            )
            head_times = least_seconds(
                {name: partial(head, head_input) for name, (_, head) in built.items()}, max(2, repeats // 8)
            )
            cells = []
            for times in (layer_times, head_times):
                best = min(times["few_rows"], times["onednn"])
                cells += [f"{times[w] * 1e3:.3f}" for w in WAYS] + [f"**{times['dispatched'] / best:.2f}**"]
            print(f"| {rows} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], nargs="+", default=["bfloat16", "float32"]
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROW_COUNTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in args.dtype:
        if not cpu_ops.is_built() or not torch.ops.pagedllm.few_rows_linear_available(name):
            raise SystemExit(f"no few-rows kernel for {name} in this CPU's build")
        run_dtype(getattr(torch, name), args.rows)


if __name__ == "__main__":
    main()
