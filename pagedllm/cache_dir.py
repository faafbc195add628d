"""Where pagedllm keeps what it makes once and reuses across starts (converted GGUF folders,
measured kernel timings): $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))
