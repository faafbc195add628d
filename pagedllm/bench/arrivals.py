"""When each benchmark request is sent: all at once, or an open-loop arrival process.

Gaps between arrivals follow a gamma distribution with shape `burstiness` and mean 1/rate, as in
`vllm bench serve`: burstiness 1 is a Poisson process (exponential gaps), below 1 requests come in
bursts, above 1 they come more evenly, and infinity gives constant gaps.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times in seconds after the start, one per request, non-decreasing, the first at 0.

    The gaps are rescaled so the last arrival lands at exactly (num_requests - 1) / request_rate:
    a sum of random gaps drifts a few percent from it, which would move the measured throughput
    with the seed rather than with the server.
    """
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if burstiness <= 0 or math.isnan(burstiness):
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if num_requests <= 1 or math.isinf(request_rate):
        return [0.0] * num_requests
    num_gaps = num_requests - 1
    if math.isinf(burstiness):
        gaps = np.full(num_gaps, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_gaps)
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    if times[-1] == 0:  # very small burstiness: every gap underflowed, one burst
        return times.tolist()
    return (times * (num_gaps / request_rate / times[-1])).tolist()
