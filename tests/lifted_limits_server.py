"""The API server with the schema depth limit lifted, for tests/structured_output/test_grammar_limits.py:
`python -m tests.lifted_limits_server ARGS` (the api_server's own flags). A schema nesting
hundreds of objects then reaches the compile processes and compiles for many seconds, as it did
before the limit: what the pool's timeout, kill and shutdown must bound. The compile timeout
comes from $PAGEDLLM_TEST_COMPILE_TIMEOUT_S.
"""

from __future__ import annotations

import os
import sys

from pagedllm import limits
from pagedllm.entrypoints.openai import api_server

if __name__ == "__main__":
    limits.MAX_GRAMMAR_DEPTH = 100_000
    limits.GRAMMAR_COMPILE_TIMEOUT_S = float(os.environ["PAGEDLLM_TEST_COMPILE_TIMEOUT_S"])
    api_server.main(sys.argv[1:])
