"""One request decoding at --tensor-parallel-size 1 or N: ms per token, and how much of it rank 0
spends in all-reduces and in the step broadcast (docs/scaling.md).

    python benchmarks/tp_model.py /tmp/tp-model
    python benchmarks/tp_decode.py /tmp/tp-model 1
    python benchmarks/tp_decode.py /tmp/tp-model 2
"""

from __future__ import annotations

import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import TPGroup

NUM_TOKENS = 100
_spent = {"all_reduce": 0.0, "broadcast": 0.0, "calls": 0}


def _timed(name: str, method):
    def wrapper(self, x):
        start = time.perf_counter()
        try:
            return method(self, x)
        finally:
            _spent[name] += time.perf_counter() - start
            _spent["calls"] += name == "all_reduce"

    return wrapper


def main(model: str, tp_size: int) -> None:
    TPGroup.all_reduce = _timed("all_reduce", TPGroup.all_reduce)  # rank 0 only: it runs here
    TPGroup.broadcast = _timed("broadcast", TPGroup.broadcast)
    llm = LLM(model, tensor_parallel_size=tp_size, max_model_len=1024, disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    llm.generate(["A warm-up"], params, use_tqdm=False)
    _spent.update(all_reduce=0.0, broadcast=0.0, calls=0)
    start = time.perf_counter()
    llm.generate(["Once upon a time"], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(
        f"TP={tp_size}: {elapsed / NUM_TOKENS * 1e3:.1f} ms per token; all-reduce "
        f"{_spent['all_reduce'] / NUM_TOKENS * 1e3:.1f} ms per step ({_spent['calls'] // NUM_TOKENS} calls), "
        f"step broadcast {_spent['broadcast'] / NUM_TOKENS * 1e3:.2f} ms"
    )
    llm.llm_engine.close()


if __name__ == "__main__":  # the mp backend spawns its ranks: they re-import this file
    main(sys.argv[1], int(sys.argv[2]))
