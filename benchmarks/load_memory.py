"""A model's start-up: seconds until the engine is ready and peak resident memory while it loads,
against the issue's bound (the file + the KV budget + 1 GiB), as `LLM(FILE)` gives them.

    .venv/bin/python benchmarks/load_memory.py FILE.gguf [--kv-cache-memory-bytes 1GiB]

Resident memory is sampled every 0.2 s from /proc/self/status (anonymous: what pagedllm holds;
file-backed: pages of the file mapped at that moment). Run it twice for a second start, whose
file pages may still be in the page cache (on a host with less memory than file + weights, not
all of them: the packed weights take the memory the cache would use).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from pagedllm import LLM
from pagedllm.config import parse_memory_size

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def resident() -> dict[str, int]:
    """This process's resident bytes now, by kind."""
    sizes = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            sizes[name] = int(value.split()[0]) * 1024
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--kv-cache-memory-bytes", default="1GiB")
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    peaks = dict.fromkeys(FIELDS, 0)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for name, size in resident().items():
                peaks[name] = max(peaks[name], size)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    llm = LLM(
        str(args.file), max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes
    )
    ready = time.perf_counter() - start
    done.set()
    sampler.join()
    gib = 2**30
    file_size, kv = args.file.stat().st_size, parse_memory_size(args.kv_cache_memory_bytes)
    bound = file_size + kv + gib
    print(
        f"{args.file.name}: ready in {ready:.1f} s; peak RSS {peaks['VmRSS'] / gib:.2f} GiB "
        f"(anonymous {peaks['RssAnon'] / gib:.2f}, file-backed {peaks['RssFile'] / gib:.2f}); "
        f"bound: file {file_size / gib:.2f} + KV {kv / gib:.2f} + 1 = {bound / gib:.2f} GiB "
        f"({'within' if peaks['VmRSS'] <= bound else 'OVER'})"
    )
    llm.llm_engine.close()


if __name__ == "__main__":
    main()
