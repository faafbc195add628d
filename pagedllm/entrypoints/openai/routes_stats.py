"""The operator's routes: /health, /version, /metrics (Prometheus), /stats (LiveStats' JSON, with
where prompts stop sharing a prefix), /stats/kv_blocks (the KV block map, read on the engine
thread between two steps) and /dashboard (a page that polls both; its chart library is served
under /static, STATIC_DIR, by the app)."""

from __future__ import annotations

from http import HTTPStatus
from pathlib import Path

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm.analysis.block_map import block_holders, block_map
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.metrics.live_stats import LiveStats
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.version import __version__

_DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_text()  # polls GET /stats
STATIC_DIR = Path(__file__).parent / "static"  # the page's chart library (uPlot), no CDN


def make_router(
    engine: AsyncLLM, metrics: PrometheusMetrics, live_stats: LiveStats, *, divergence_text: bool
) -> APIRouter:
    router = APIRouter()
    block_size = engine.config.block_size

    @router.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running", type="server_error")
        return Response(status_code=HTTPStatus.OK)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/stats")
    async def stats() -> dict:
        snapshot = live_stats.snapshot()
        groups = await engine.divergence_report()  # off the event loop
        if groups is not None:
            snapshot["prefix_divergence"] = [g.as_dict(divergence_text, block_size) for g in groups]
        return snapshot

    @router.get("/stats/kv_blocks")
    async def kv_block_map() -> dict:
        return await engine.read_block_pool(block_map)

    @router.get("/stats/kv_blocks/{block_id}")
    async def kv_block(block_id: int) -> dict:
        try:
            return await engine.read_block_tables(lambda pool, tables: block_holders(pool, tables, block_id))
        except IndexError as error:
            raise APIError(HTTPStatus.NOT_FOUND, str(error)) from None

    @router.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_DASHBOARD_HTML)

    return router
