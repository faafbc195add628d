"""vLLM's histogram buckets (vllm/v1/metrics/buckets.py), so quantiles and heatmaps built for its
dashboards read the same here."""

from __future__ import annotations

REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
TIME_TO_FIRST_TOKEN = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                       10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
INTER_TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                       10.0, 20.0, 40.0, 80.0]  # fmt: skip
ITERATION_TOKENS = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0]
NUM_PREEMPTIONS = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
"""vLLM's buckets for preemptions per request."""
REQUEST_PARAMS_N = [1.0, 2.0, 5.0, 10.0, 20.0]


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets), for token counts."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1
