"""/metrics keeps a series of accepted draft tokens per draft position for the first 16 positions
at most (issue 45): a 1,024-token draft limit must not mean 1,024 series in every scrape."""

from __future__ import annotations

import re

import pytest

from pagedllm.metrics.prometheus import MAX_EXPORTED_DRAFT_POSITIONS, PrometheusMetrics


@pytest.mark.parametrize(("num_speculative_tokens", "exported"), [(4, 4), (16, 16), (1024, 16)])
def test_accepted_tokens_by_position_are_capped(num_speculative_tokens, exported):
    metrics = PrometheusMetrics(
        "m",
        max_model_len=128,
        cache_config={"block_size": "16"},
        num_speculative_tokens=num_speculative_tokens,
    )
    lines = metrics.render().decode().splitlines()
    series = [
        line for line in lines if line.startswith("pagedllm:spec_decode_num_accepted_tokens_per_pos_total{")
    ]
    positions = sorted(int(re.findall(r'position="(\d+)"', line)[0]) for line in series)
    assert positions == list(range(exported)) and exported <= MAX_EXPORTED_DRAFT_POSITIONS
