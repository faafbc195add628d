"""A grammar compile process for tests/structured_output/test_compile_pool.py:
its main() runs compile_worker's, except for regexes that start with a marker:

- `slow`: compiles after sleeping $PAGEDLLM_TEST_SLOW_COMPILE_S (a legal grammar that holds its
  process for as long as a test needs, on a busy host as on a quiet one);
- `crash`: the process exits mid-compile, as if killed (OOM);
- `crash-once`: the same, the first time only (a file named by $PAGEDLLM_TEST_CRASH_FLAG remembers).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.structured_output import backend, compile_worker

if TYPE_CHECKING:  # imported by compile_worker.main, once stdout is the reply stream's alone
    import xgrammar

_compile_grammar = backend.compile_grammar


def _compile_grammar_for_tests(
    compiler: xgrammar.GrammarCompiler, key: backend.GrammarKey, vocab_size: int
) -> xgrammar.CompiledGrammar:
    kind, spec, _ = key
    if kind == "regex" and spec.startswith("crash-once"):
        flag = Path(os.environ["PAGEDLLM_TEST_CRASH_FLAG"])
        if not flag.exists():
            flag.touch()
            os._exit(1)
    elif kind == "regex" and spec.startswith("crash"):
        os._exit(1)
    elif kind == "regex" and spec.startswith("slow"):
        time.sleep(float(os.environ.get("PAGEDLLM_TEST_SLOW_COMPILE_S", "5")))
    return _compile_grammar(compiler, key, vocab_size)


def main() -> None:
    backend.compile_grammar = _compile_grammar_for_tests  # compile_worker.main imports it at its start
    compile_worker.main()


if __name__ == "__main__":
    main()
