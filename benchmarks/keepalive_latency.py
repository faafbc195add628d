"""Non-streamed requests on one kept-alive connection (as the OpenAI SDK sends them) against the
same requests each on a new connection, to one server, in one run.

    .venv/bin/python benchmarks/keepalive_latency.py [--requests 30]

A kept-alive connection should cost no more than a new one. When the server's sockets lacked
TCP_NODELAY, a response written as headers then body waited for the client's delayed ACK on a
reused connection (~40 ms a request; a new connection's first response does not wait).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import httpx

from pagedllm.bench.server_process import ServerProcess
from pagedllm.cpu_features import describe_host

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", "256MiB"]
REQUESTS = {
    "/tokenize": {"prompt": "The capital of France is"},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0},
}


def median_ms(url: str, path: str, body: dict, num: int, kept_alive: bool) -> float:
    seconds = []
    with httpx.Client(base_url=url, timeout=60) as shared:
        shared.post(path, json=body)  # warm: the first request of a connection is not measured
        for _ in range(num):
            start = time.perf_counter()
            if kept_alive:
                shared.post(path, json=body).raise_for_status()
            else:
                with httpx.Client(base_url=url, timeout=60) as fresh:
                    fresh.post(path, json=body).raise_for_status()
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(f"{describe_host()}; git {commit.strip()}; {args.requests} requests a cell, medians")
    server = ServerProcess(SERVER_ARGS)
    try:
        assert server.url is not None
        for path, body in REQUESTS.items():
            kept = median_ms(server.url, path, body, args.requests, kept_alive=True)
            fresh = median_ms(server.url, path, body, args.requests, kept_alive=False)
            ratio = kept / fresh
            print(f"{path}: kept-alive {kept:.1f} ms, new connection {fresh:.1f} ms, ratio {ratio:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
