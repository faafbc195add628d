"""/metrics beside a real vLLM scrape (tests/fixtures/vllm_cpu_metrics.txt; its first lines say which
vLLM and command): with --metrics-prefix vllm, every family vLLM shows is served here with the same
type and label names (histograms with the same buckets), or is listed in NOT_APPLICABLE with why;
and the figures add up for the requests sent."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..helpers import MODEL, TEST_ENGINE_ARGS, RemoteServer, server_engine_args

pytestmark = pytest.mark.slow  # a server of its own

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm_cpu_metrics.txt"

NOT_APPLICABLE = {
    "vllm:engine_sleep_state": "no sleep mode (weights offloaded or discarded) here",
    "vllm:external_prefix_cache_queries": "no KV connector: no prefix cache shared across instances",
    "vllm:external_prefix_cache_hits": "no KV connector: no prefix cache shared across instances",
    "vllm:mm_cache_queries": "text-only models: no multi-modal input cache",
    "vllm:mm_cache_hits": "text-only models: no multi-modal input cache",
    "vllm:estimated_flops_per_gpu": "vLLM's analytic per-GPU cost model (0 in its CPU scrape too)",
    "vllm:estimated_read_bytes_per_gpu": "vLLM's analytic per-GPU cost model (0 in its CPU scrape too)",
    "vllm:estimated_write_bytes_per_gpu": "vLLM's analytic per-GPU cost model (0 in its CPU scrape too)",
}
NOT_YET = {
    "vllm:request_max_num_generation_tokens": "needs each sequence's parent (n); RequestOutput lacks it",
}
"""Meaningful here, but the engine's outputs do not carry the figure yet (pagedllm/outputs.py)."""
# Histograms of token counts: their buckets run 1, 2, 5, ... up to max_model_len.
TOKEN_HISTOGRAMS = {
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_prefill_kv_computed_tokens",
}
PROMPT = (  # over two KV blocks of 16 tokens: the second request finds them cached
    "The history of the printing press begins in the fifteenth century, when a goldsmith in the city of "
    "Mainz combined a screw press, oil-based ink and movable metal type into one working system"
)


class Family:
    """One family of a scrape: its type, label names (le and quantile aside) and bucket bounds."""

    def __init__(self, type: str) -> None:
        self.type = type
        self.labels: set[str] = set()
        self.buckets: set[float] = set()


def families(text: str) -> dict[str, Family]:
    """Every family of a scrape but the `_created` timestamps (they follow their counter or histogram)."""
    found: dict[str, Family] = {}
    for parsed in text_string_to_metric_families(text):
        if parsed.name.endswith("_created"):
            continue
        family = found.setdefault(parsed.name, Family(parsed.type))
        for sample in parsed.samples:
            family.labels |= set(sample.labels) - {"le", "quantile"}
            if "le" in sample.labels:
                family.buckets.add(float(sample.labels["le"]))
    return found


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels other than model_name and engine): value}."""
    return {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))),
        ): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer([*server_engine_args(), "--metrics-prefix", "vllm"])
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def traffic(server) -> tuple[str, list[tuple[dict, int]]]:
    """Requests like the fixture's (plain, streamed, chat, n=2) and a repeated prompt, then the
    scrape once every sequence is recorded; with each request's usage and n."""
    sent = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}),  # a prefix-cache hit
        ("/v1/completions", {"prompt": "Water boils at", "max_tokens": 5, "n": 2, "temperature": 1.0}),
        ("/v1/completions", {"prompt": "List three colours:", "max_tokens": 7, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True},
        ),
        # no max_tokens: it ends at EOS or the first full stop
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "stop": ["."]}),
    ]
    usages = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for path, body in sent:
            body = {"model": MODEL, "temperature": 0.0, "ignore_eos": "max_tokens" in body, **body}
            if body.get("stream"):
                body["stream_options"] = {"include_usage": True}
                with http.stream("POST", path, json=body) as response:
                    assert response.status_code == 200
                    chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
                usage = json.loads(chunks[-1][len("data: ") :])["usage"]
            else:
                response = http.post(path, json=body)
                assert response.status_code == 200, response.text
                usage = response.json()["usage"]
            usages.append((usage, body.get("n", 1)))
        num_sequences = sum(n for _, n in usages)
        for _ in range(100):  # the engine thread records a step just after delivering its outputs
            text = http.get("/metrics").text
            successes = [v for (name, _), v in samples(text).items() if name == "vllm:request_success_total"]
            if sum(successes) == num_sequences:
                return text, usages
            time.sleep(0.05)
        pytest.fail("the scrape never counted every finished request")


def test_every_vllm_family_is_here_or_listed(traffic):
    vllm, ours = families(FIXTURE.read_text()), families(traffic[0])
    assert not (set(NOT_APPLICABLE) | set(NOT_YET)) & set(ours), "a family listed as absent is served"
    missing = set(vllm) - set(ours) - set(NOT_APPLICABLE) - set(NOT_YET)
    assert not missing, f"vLLM families neither served nor listed: {sorted(missing)}"
    for name in set(vllm) & set(ours):
        theirs, mine = vllm[name], ours[name]
        assert mine.type == theirs.type, name
        if name.endswith("_info"):  # labels are config fields: those that exist here
            assert mine.labels - {"model_name"} <= theirs.labels, name
        elif theirs.labels and mine.labels:
            assert mine.labels == theirs.labels, name
        if name in TOKEN_HISTOGRAMS:  # 1, 2, 5, ... up to our smaller max_model_len
            limit = TEST_ENGINE_ARGS["max_model_len"]
            assert mine.buckets == {b for b in theirs.buckets if b <= limit} | {math.inf}, name
        elif name.startswith("vllm:"):
            assert mine.buckets == theirs.buckets, name


def test_every_vllm_family_carries_the_engine_label(traffic):
    for name, family in families(traffic[0]).items():
        if name.startswith("vllm:") and name != "vllm:admission_rejections":  # vLLM's has none either
            assert "engine" in family.labels, name


def test_the_figures_add_up(traffic):
    text, usages = traffic
    values = samples(text)
    prompt_tokens = sum(usage["prompt_tokens"] * n for usage, n in usages)  # each sequence prefills
    generated = sum(usage["completion_tokens"] for usage, _ in usages)
    assert values[("vllm:prompt_tokens_total", ())] == prompt_tokens
    assert values[("vllm:generation_tokens_total", ())] == generated
    computed = values[("vllm:request_prefill_kv_computed_tokens_sum", ())]
    cached = values[("vllm:prompt_tokens_cached_total", ())]
    assert computed + cached == prompt_tokens
    assert values[("vllm:prompt_tokens_by_source_total", (("source", "local_compute"),))] == computed
    assert cached >= 16  # the repeated prompt found its first block
    assert (
        values[("vllm:prompt_tokens_cached_by_source_total", (("source", "device"),))]
        == values[("vllm:prefix_cache_hits_total", ())]
    )
    # every token the model took went through some step: computed prompt tokens and generated ones
    assert values[("vllm:iteration_tokens_total_count", ())] > 0
    assert values[("vllm:iteration_tokens_total_sum", ())] == computed + generated
    assert values[("vllm:request_params_n_count", ())] == len(usages)
    assert values[("vllm:request_params_n_sum", ())] == sum(n for _, n in usages)
    # the streamed chat sets no max_tokens: not observed
    assert values[("vllm:request_params_max_tokens_count", ())] == sum(n for _, n in usages) - 1
    assert values[("vllm:request_inference_time_seconds_count", ())] == sum(n for _, n in usages)
    completions = (
        "http_requests_total",
        (("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx")),
    )
    assert values[completions] == 4
    handlers = {dict(labels).get("handler") for name, labels in values if name.startswith("http_")}
    assert "/metrics" not in handlers  # scraped all along, left out as vLLM leaves it out
    assert values[("process_resident_memory_bytes", ())] > 0
