"""The router's /stats, /stats/kv_blocks and /dashboard: the replicas' own, merged into one.

/stats has the shape of one replica's (so the replica's dashboard page reads it as it is) plus
`replicas`, each replica's own snapshot or why it has none. Counters and gauges are summed, the
prefix-cache hit rates are recomputed from the summed hits and queries, and the KV cache usage is
weighted by each replica's blocks. Two things cannot be merged exactly from what replicas report:
latency percentiles (each replica keeps its own window) are the worst replica's, an upper bound
of the pooled percentile; and the charts' samples, taken by each replica on its own clock, are
aligned on SAMPLE_INTERVAL_S slots, where a replica without a sample in a slot counts with its
latest earlier one. The block map lays the replicas' blocks end to end, in --replica order.

The caller's Authorization header goes to every replica: a replica that refuses it (401) has its
answer passed back as it is, so the router shows nothing a replica would not.
"""

from __future__ import annotations

import asyncio
import math
from http import HTTPStatus
from pathlib import Path

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.router.policy import Replica
from pagedllm.entrypoints.router.replicas import ReplicaSet
from pagedllm.metrics.live_stats import SAMPLE_INTERVAL_S, TOP_USERS
from pagedllm.metrics.stats import PrefixCacheStats, SpecDecodeStats

_PAGE_DIR = Path(errors.__file__).parent  # the replica's dashboard.html and its static/ chart library
_SUMMED = ("running", "waiting", "finished", "preemptions", "prompt_tokens_computed", "generation_tokens")
_KV_SUMMED = ("num_blocks", "free_blocks", "cached_blocks", "used_token_slots")
_RATES = ("prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting")
STATS_TIMEOUT_S = 10.0


def add_stats_routes(app: FastAPI, client: httpx.AsyncClient, replica_set: ReplicaSet) -> None:
    """GET /stats, /stats/kv_blocks, /stats/kv_blocks/{id}, /dashboard and /static on the router."""

    @app.get("/stats")
    async def stats(request: Request) -> Response:
        answers = await _get_all(client, replica_set.replicas, "/stats", request)
        if (refusal := _refusal(answers)) is not None:
            return refusal
        snapshots = {url: a.json() for url, a in answers.items() if isinstance(a, httpx.Response)}
        merged = merge_stats(list(snapshots.values()))
        merged["replicas"] = {
            url: snapshots.get(url, {"error": _why(answer)}) for url, answer in answers.items()
        }
        return JSONResponse(merged)

    @app.get("/stats/kv_blocks")
    async def kv_blocks(request: Request) -> Response:
        answers = await _get_all(client, replica_set.replicas, "/stats/kv_blocks", request)
        if (refusal := _refusal(answers)) is not None:
            return refusal
        return JSONResponse(
            merge_block_maps([a.json() for a in answers.values() if isinstance(a, httpx.Response)])
        )

    @app.get("/stats/kv_blocks/{block_id}")
    async def kv_block(block_id: int, request: Request) -> Response:
        """The replica holding the merged map's block `block_id`, asked about its own block."""
        answers = await _get_all(client, replica_set.replicas, "/stats/kv_blocks", request)
        if (refusal := _refusal(answers)) is not None:
            return refusal
        offset = 0
        for url, answer in answers.items():
            if not isinstance(answer, httpx.Response):
                continue
            num_blocks = answer.json()["num_blocks"]
            if offset <= block_id < offset + num_blocks:
                holders = await client.get(
                    f"{url}/stats/kv_blocks/{block_id - offset}",
                    headers=_auth(request),
                    timeout=STATS_TIMEOUT_S,
                )
                if holders.status_code != HTTPStatus.OK:
                    return Response(holders.content, holders.status_code, media_type="application/json")
                return JSONResponse(shift_holders(holders.json(), offset))
            offset += num_blocks
        message = f"block {block_id} does not exist: the replicas have blocks 0-{offset - 1}"
        return errors.error_response(errors.APIError(HTTPStatus.NOT_FOUND, message))

    dashboard_html = (_PAGE_DIR / "dashboard.html").read_text()  # polls stats and stats/kv_blocks

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html)

    app.mount("/static", StaticFiles(directory=_PAGE_DIR / "static"), name="static")


async def _get_all(
    client: httpx.AsyncClient, replicas: list[Replica], path: str, request: Request
) -> dict[str, httpx.Response | Exception]:
    """Each healthy replica's 200 or 401 answer to GET path, else what went wrong, by URL in
    --replica order (the order the block map lays them out)."""

    async def get(replica: Replica) -> httpx.Response | Exception:
        try:
            answer = await client.get(replica.url + path, headers=_auth(request), timeout=STATS_TIMEOUT_S)
        except httpx.HTTPError as error:
            return error
        if answer.status_code in (HTTPStatus.OK, HTTPStatus.UNAUTHORIZED):
            return answer
        return RuntimeError(f"{path} answered {answer.status_code}")

    async def down() -> Exception:
        return RuntimeError("down (its /health failed)")

    answers = await asyncio.gather(*(get(r) if r.is_healthy else down() for r in replicas))
    return {r.url: answer for r, answer in zip(replicas, answers, strict=True)}


def _auth(request: Request) -> dict[str, str]:
    authorization = request.headers.get("authorization")
    return {"Authorization": authorization} if authorization else {}


def _refusal(answers: dict[str, httpx.Response | Exception]) -> Response | None:
    """A replica's 401 as it is; 503 when no replica answered at all."""
    for answer in answers.values():
        if isinstance(answer, httpx.Response) and answer.status_code == HTTPStatus.UNAUTHORIZED:
            return Response(answer.content, answer.status_code, media_type="application/json")
    if not any(isinstance(a, httpx.Response) for a in answers.values()):
        reasons = "; ".join(f"{url}: {_why(a)}" for url, a in answers.items())
        error = errors.APIError(
            HTTPStatus.SERVICE_UNAVAILABLE, f"no replica answered ({reasons})", type="server_error"
        )
        return errors.error_response(error)
    return None


def _why(answer: httpx.Response | Exception) -> str:
    return f"{type(answer).__name__}: {answer}" if isinstance(answer, Exception) else "answered"


# ---- merging: pure functions of the replicas' JSON ------------------------------------------------


def merge_stats(snapshots: list[dict]) -> dict:
    """One /stats snapshot for replicas' snapshots (at least one)."""
    merged: dict = {name: sum(s[name] for s in snapshots) for name in _SUMMED}
    merged["model"] = ", ".join(dict.fromkeys(s["model"] for s in snapshots))
    merged["kv_cache"] = _merge_kv_cache([s["kv_cache"] for s in snapshots])
    merged["prefix_cache"] = _merge_prefix_cache([s["prefix_cache"] for s in snapshots])
    merged["latency_s"] = {
        phase: _worst([s["latency_s"][phase] for s in snapshots]) for phase in snapshots[0]["latency_s"]
    }
    merged["window"] = sum(s["window"] for s in snapshots)
    merged["spec_decode"] = SpecDecodeStats.sum_of_snapshots(
        [s["spec_decode"] for s in snapshots if s.get("spec_decode")]
    )
    block_weights = [s["kv_cache"]["num_blocks"] for s in snapshots]
    merged["history"] = merge_histories([s["history"] for s in snapshots], block_weights)
    if any("prefix_divergence" in s for s in snapshots):  # replicas started with the analysis on
        merged["prefix_divergence"] = [g for s in snapshots for g in s.get("prefix_divergence", [])]
    return merged


def _merge_kv_cache(caches: list[dict]) -> dict:
    merged = {name: sum(c[name] for c in caches) for name in _KV_SUMMED}
    merged["usage"] = _weighted([c["usage"] for c in caches], [c["num_blocks"] for c in caches])
    sizes = {c["block_size"] for c in caches}
    merged["block_size"] = sizes.pop() if len(sizes) == 1 else None
    return merged


def _merge_prefix_cache(caches: list[dict]) -> dict:
    """Counts summed and rates recomputed from the sums, in the replicas' own shape."""
    return PrefixCacheStats.sum_of_snapshots(caches).snapshot(TOP_USERS)


def _worst(percentiles: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each percentile's largest value over replicas: no pooled percentile is above it."""
    known = [p for p in percentiles if p is not None]
    return {q: max(p[q] for p in known) for q in known[0]} if known else None


def _weighted(values: list[float], weights: list[int]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0


def merge_histories(histories: list[dict[str, list]], block_weights: list[int]) -> dict[str, list]:
    """The replicas' chart columns on shared time slots (see the module docstring).

    Rates and request counts are summed, KV usage weighted by blocks, the hit rate and the draft
    acceptance are the means of the replicas' (a sample carries no counts to pool) and TTFT
    percentiles the worst replica's.
    """
    slots = sorted({math.floor(t / SAMPLE_INTERVAL_S) for h in histories for t in h["time"]})
    columns: dict[str, list] = {name: [] for name in histories[0]}
    cursors = [0] * len(histories)
    for slot in slots:
        latest: list[int] = []  # per replica: its sample in this slot or its latest before it
        weights: list[int] = []
        for i, history in enumerate(histories):
            times = history["time"]
            while cursors[i] < len(times) and math.floor(times[cursors[i]] / SAMPLE_INTERVAL_S) <= slot:
                cursors[i] += 1
            if cursors[i]:
                latest.append(i)
                weights.append(block_weights[i])
        rows = [{name: histories[i][name][cursors[i] - 1] for name in columns} for i in latest]
        columns["time"].append(max(row["time"] for row in rows))
        for name in _RATES:
            columns[name].append(sum(row[name] for row in rows))
        columns["kv_cache_usage"].append(_weighted([row["kv_cache_usage"] for row in rows], weights))
        for name in ("hit_rate", "draft_acceptance"):
            if name in columns:  # (a replica of an older version has no draft_acceptance)
                rates = [row[name] for row in rows if row.get(name) is not None]
                columns[name].append(sum(rates) / len(rates) if rates else None)
        for name in ("ttft_p50", "ttft_p95"):
            known = [row[name] for row in rows if row[name] is not None]
            columns[name].append(max(known) if known else None)
    return columns


def merge_block_maps(maps: list[dict]) -> dict:
    """The replicas' block maps end to end; block ids of replica k start after those before it."""
    return {
        "num_blocks": sum(m["num_blocks"] for m in maps),
        "states": "".join(m["states"] for m in maps),
        "counts": {name: sum(m["counts"][name] for m in maps) for name in maps[0]["counts"]},
    }


def shift_holders(holders: dict, offset: int) -> dict:
    """A replica's answer about one of its blocks, in the merged map's block ids."""
    requests = [{**r, "block_ids": [b + offset for b in r["block_ids"]]} for r in holders["requests"]]
    return {**holders, "block_id": holders["block_id"] + offset, "requests": requests}
