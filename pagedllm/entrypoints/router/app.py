"""The router's HTTP face: the same OpenAI API as one replica, served by several.

POST /v1/completions and /v1/chat/completions go to the replica the policy picks; the body and the
Authorization header pass through untouched. Until the first byte of the answer comes back a request
can move: a replica that refuses the connection or drops it is marked down and the request tries the
next one; a 502/503/504 (queue full, draining) tries the next one without marking it down. A stream
that breaks after its first chunk cannot move; it ends with an SSE error event and [DONE].

Bodies are held to a replica's bounds before anything is forwarded: over --max-request-body-bytes
is a 413 (at once when Content-Length says so, else as soon as the bytes streamed in pass it), and
JSON nested deeper than limits.MAX_JSON_DEPTH a 400, both in OpenAI's error shape, as every other
error the router makes. /stats and /dashboard merge the replicas' own (router/stats.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import limits
from pagedllm.entrypoints.openai.errors import install_error_handlers, invalid_request
from pagedllm.entrypoints.openai.middleware import BodySizeLimitMiddleware
from pagedllm.entrypoints.router.metrics import merge_scrapes, render, router_families, scrape_all
from pagedllm.entrypoints.router.policy import Replica
from pagedllm.entrypoints.router.replicas import ReplicaSet
from pagedllm.entrypoints.router.request_text import request_text
from pagedllm.entrypoints.router.stats import add_stats_routes

logger = logging.getLogger(__name__)

# Connection-level headers belong to one hop; content-length changes when httpx re-frames the body.
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "accept-encoding"}
_RESPONSE_DROP = {
    "content-length",
    "connection",
    "transfer-encoding",
    "keep-alive",
    "content-encoding",
    "date",
}
_MOVABLE_STATUSES = {HTTPStatus.BAD_GATEWAY, HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.GATEWAY_TIMEOUT}


def build_app(
    replica_set: ReplicaSet,
    request_timeout: float = 600.0,
    metrics_prefix: str = "pagedllm",
    max_request_body_bytes: int = limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The router app; its lifespan owns the HTTP client and the health checker."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await replica_set.probe_all(client)
        replica_set.start(client)
        yield
        await replica_set.shutdown()
        await client.aclose()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(client, replica_set, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _forward(client, replica_set, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for replica in replica_set.healthy():
            try:
                upstream = await client.get(f"{replica.url}/v1/models", headers=_request_headers(request))
            except httpx.TransportError as error:
                replica_set.mark_down(replica, _describe(error))
                continue
            return _plain_response(upstream)
        return _no_replica()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=HTTPStatus.OK) if replica_set.healthy() else _no_replica()

    @app.get("/metrics")
    async def metrics() -> Response:
        scrapes = await scrape_all(client, replica_set.replicas)
        families = [*merge_scrapes(scrapes), *router_families(replica_set.replicas, metrics_prefix)]
        return Response(render(families), media_type=CONTENT_TYPE_LATEST)

    add_stats_routes(app, client, replica_set)
    return app


async def _forward(
    client: httpx.AsyncClient, replica_set: ReplicaSet, request: Request, path: str
) -> Response:
    """Send a request to the policy's replica, moving it to the next while nothing has come back."""
    body = await request.body()  # BodySizeLimitMiddleware ends this with a 413 past the bound
    parsed = _parse(body)
    text = request_text(path, parsed) if isinstance(parsed, dict) else ""
    headers = _request_headers(request)
    tried: set[str] = set()
    last_refusal: Response | None = None
    while (replica := replica_set.pick(text, tried)) is not None:
        tried.add(replica.url)
        replica.num_requests += 1
        replica.num_in_flight += 1
        try:
            upstream = await client.send(
                client.build_request("POST", replica.url + path, content=body, headers=headers), stream=True
            )
        except httpx.TransportError as error:
            # Nothing has reached the client yet, so the request can still go elsewhere.
            replica.num_in_flight -= 1
            replica_set.request_failed(replica, _describe(error))
            continue
        is_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if is_stream and upstream.status_code not in _MOVABLE_STATUSES:
            return _stream_response(replica, upstream)  # it owns the in-flight count and the connection
        try:
            await upstream.aread()
        except httpx.TransportError as error:
            replica_set.request_failed(replica, _describe(error))
            continue
        finally:
            replica.num_in_flight -= 1
            await upstream.aclose()
        if upstream.status_code not in _MOVABLE_STATUSES:
            return _plain_response(upstream)
        last_refusal = _plain_response(upstream)
    return last_refusal or _no_replica()


def _parse(body: bytes) -> object:
    """The body's JSON (None if it is not JSON: any replica answers that 400). Raises a 400 for
    nesting deeper than a replica takes; json's own recursion limit is far deeper than that."""
    try:
        parsed = json.loads(body)
    except RecursionError:
        deep = ValueError(limits.TOO_DEEP)
        raise invalid_request(deep) from None
    except ValueError:
        return None
    if isinstance(parsed, dict):
        try:
            limits.check_text_and_depth(parsed)  # the replica's own check, so both answer alike
        except ValueError as error:
            raise invalid_request(error) from None
    return parsed


def _stream_response(replica: Replica, upstream: httpx.Response) -> StreamingResponse:
    """Pass SSE through chunk by chunk; a replica lost mid-stream ends it with an error event."""

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as error:
            logger.warning("Replica %s dropped a stream mid-way (%s)", replica.url, _describe(error))
            message = f"the replica serving this stream failed ({_describe(error)}); send the request again"
            event = {"error": {"message": message, "type": "server_error", "code": HTTPStatus.BAD_GATEWAY}}
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            replica.num_in_flight -= 1
            await upstream.aclose()

    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=_response_headers(upstream))


def _plain_response(upstream: httpx.Response) -> Response:
    """A fully read upstream answer, as is."""
    return Response(upstream.content, status_code=upstream.status_code, headers=_response_headers(upstream))


def _request_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _no_replica() -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": "no replica is healthy; check the replicas' logs and their /health",
                "type": "server_error",
                "code": HTTPStatus.SERVICE_UNAVAILABLE,
            }
        },
        status_code=HTTPStatus.SERVICE_UNAVAILABLE,
    )
