"""The router's /metrics: every healthy replica's scrape with a `replica` label added to each sample
(so a dashboard can sum, or split by replica, as it likes), plus the router's own view of each replica.

Families of the same name from different replicas merge into one (Prometheus text allows a family
once); a replica that cannot be scraped shows up only as `..._router_replica_healthy 0`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.router.policy import Replica

REPLICA_LABEL = "replica"


def merge_scrapes(scrapes: dict[str, str]) -> list[Metric]:
    """One family per name over all replicas' Prometheus text, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for url, text in scrapes.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples.extend(
                sample._replace(labels={**sample.labels, REPLICA_LABEL: url}) for sample in family.samples
            )
    return list(families.values())


def router_families(replicas: list[Replica], prefix: str) -> list[Metric]:
    """What only the router knows: which replicas are up, their load and the requests sent there."""
    healthy = GaugeMetricFamily(
        f"{prefix}_router_replica_healthy", "1 when the replica answers /health", labels=[REPLICA_LABEL]
    )
    in_flight = GaugeMetricFamily(
        f"{prefix}_router_requests_in_flight",
        "Requests the router has open on the replica",
        labels=[REPLICA_LABEL],
    )
    requests = CounterMetricFamily(
        f"{prefix}_router_requests", "Requests the router sent to the replica", labels=[REPLICA_LABEL]
    )
    failures = CounterMetricFamily(
        f"{prefix}_router_replica_failures",
        "Requests that failed on the replica before any byte came back (retried elsewhere)",
        labels=[REPLICA_LABEL],
    )
    for replica in replicas:
        healthy.add_metric([replica.url], float(replica.is_healthy))
        in_flight.add_metric([replica.url], replica.num_in_flight)
        requests.add_metric([replica.url], replica.num_requests)
        failures.add_metric([replica.url], replica.num_failures)
    return [healthy, in_flight, requests, failures]


async def scrape_all(client: httpx.AsyncClient, replicas: list[Replica]) -> dict[str, str]:
    """Each healthy replica's /metrics text; one that fails is left out of this scrape."""

    async def scrape(replica: Replica) -> str | None:
        try:
            response = await client.get(f"{replica.url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    healthy = [r for r in replicas if r.is_healthy]
    texts = await asyncio.gather(*(scrape(r) for r in healthy))
    return {r.url: text for r, text in zip(healthy, texts, strict=True) if text is not None}


def render(families: Iterable[Metric]) -> bytes:
    """Prometheus text (0.0.4) of ready-made families, through prometheus_client's own writer."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry)


class _Families:
    """A collector that hands over families built elsewhere (one scrape's worth)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
