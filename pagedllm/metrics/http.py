"""http_* families on /metrics, the ones vLLM's server exports: prometheus-fastapi-instrumentator's
defaults (http_requests_total by handler, method and status; http_request_duration_seconds and
_highr_seconds; request and response sizes), on the registry the /metrics route renders."""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

# Monitoring routes, polled all day (vLLM leaves its own out too): patterns matched against the route.
UNMEASURED_ROUTES = ["^/metrics$", "^/health$", "^/version$", "^/stats(/|$)", "^/dashboard$", "^/static(/|$)"]


def instrument_http(app: FastAPI, registry: CollectorRegistry) -> None:
    """Measure every request from the middleware added here inward: add it last to see them all."""
    Instrumentator(excluded_handlers=UNMEASURED_ROUTES, registry=registry).instrument(app)
