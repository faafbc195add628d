"""examples/grafana/pagedllm-dashboard.json against real servers: every metric its PromQL names is on
/metrics as exported, under either prefix (its `prefix` variable: pagedllm, or vllm with
--metrics-prefix vllm)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..helpers import RemoteServer, server_engine_args

pytestmark = pytest.mark.slow  # servers of its own

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "pagedllm-dashboard.json"
MODEL = "SmolLM2-135M-Instruct"


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variables = dashboard["templating"]["list"]
    return exprs + [v["definition"] for v in variables if v["type"] == "query"]


def metric_names(expr: str, prefix: str) -> set[str]:
    return {f"{prefix}:{name}" for name in re.findall(r"\$\{prefix\}:([a-zA-Z0-9_:]+)", expr)}


@pytest.fixture(scope="module", params=["pagedllm", "vllm"])
def scrape(request) -> tuple[str, set[str]]:
    """(prefix, the sample names of a /metrics scrape after one request with a caller)."""
    server = RemoteServer([*server_engine_args(), "--metrics-prefix", request.param])
    try:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "user": "grafana"}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    names = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    return request.param, names


def test_every_metric_in_the_dashboard_is_exported(scrape):
    prefix, scraped_names = scrape
    exprs = queries(json.loads(DASHBOARD.read_text()))
    assert all("${prefix}:" in expr for expr in exprs), "every selector goes through the prefix variable"
    used = set().union(*(metric_names(expr, prefix) for expr in exprs))
    breakdowns = {f"{prefix}:prefix_cache_hits_by_{label}_total" for label in ("prompt_length", "user")}
    assert breakdowns <= used
    assert used - scraped_names == set()


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["prefix"]["query"] == "pagedllm,vllm"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
