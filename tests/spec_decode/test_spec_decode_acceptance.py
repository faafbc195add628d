"""benchmarks/spec_decode/acceptance.py reads vLLM's spec_decode counters from /metrics text (the
lines below are vLLM CPU 0.32.0's, after one ngram request) under any prefix, and nothing else:
not the `_created` timestamps, not the per-position counters."""

from __future__ import annotations

from ..helpers import benchmark_module

acceptance = benchmark_module("spec_decode/acceptance.py")

VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="SmolLM2-135M-Instruct"} 27.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.7961848276287806e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 108.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 61.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 21.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 16.0
"""


def test_vllm_counters_are_read() -> None:
    counts = acceptance.parse_metrics(VLLM_METRICS)
    assert counts == acceptance.SpecCounts(num_drafts=27, num_draft_tokens=108, num_accepted_tokens=61)
    assert counts.acceptance_rate == 61 / 108
    assert counts.mean_acceptance_length == 1 + 61 / 27


def test_any_prefix_and_label_sets_are_summed() -> None:
    text = (
        VLLM_METRICS.replace("vllm:", "pagedllm:") + 'pagedllm:spec_decode_num_drafts_total{engine="1"} 3\n'
    )
    assert acceptance.parse_metrics(text).num_drafts == 30


def test_a_server_without_the_counters_gives_none() -> None:
    assert acceptance.parse_metrics("pagedllm:num_requests_running 0.0\n") is None
    assert (acceptance.SpecCounts(5, 20, 10) - acceptance.SpecCounts(1, 4, 2)).num_accepted_tokens == 8
