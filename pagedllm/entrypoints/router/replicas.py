"""The replicas behind the router: which are up (a periodic GET /health, plus failures seen on real
requests) and which one the policy picks next.

All state is touched only from the router's event loop, so counts need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from pagedllm.entrypoints.router.policy import Policy, Replica
from pagedllm.entrypoints.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


class ReplicaSet:
    """Replicas, the policy over them and the health checker that takes them out and back in."""

    def __init__(
        self,
        urls: list[str],
        policy: Policy,
        health_interval: float = 5.0,
        chunk_chars: int = 64,
        max_index_chunks: int = 65536,
    ) -> None:
        if not urls:
            raise ValueError("the router needs at least one --replica URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is given twice: {', '.join(urls)}")
        self.replicas = [Replica(url.rstrip("/"), PrefixIndex(chunk_chars, max_index_chunks)) for url in urls]
        self.policy = policy
        self.health_interval = health_interval
        self._health_task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.is_healthy]

    def pick(self, text: str, tried: set[str]) -> Replica | None:
        """The policy's choice among healthy replicas not yet tried for this request, or None."""
        candidates = [r for r in self.healthy() if r.url not in tried]
        return self.policy.select(text, candidates) if candidates else None

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out until a health probe succeeds; its index goes too (a restart loses
        the cache, and a stale index would pull prefixes back to a cold replica)."""
        if replica.is_healthy:
            logger.warning("Replica %s is down (%s); requests go to the others", replica.url, reason)
        replica.is_healthy = False
        replica.index.clear()

    def request_failed(self, replica: Replica, reason: str) -> None:
        """A request could not reach the replica or lost it before any answer: count it, take it out."""
        replica.num_failures += 1
        self.mark_down(replica, reason)

    async def probe(self, client: httpx.AsyncClient, replica: Replica) -> None:
        """GET /health: 200 puts the replica (back) in, anything else takes it out."""
        try:
            response = await client.get(f"{replica.url}/health", timeout=5.0)
            reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as error:
            reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if reason is not None:
            if replica.is_healthy:
                self.mark_down(replica, reason)
        elif not replica.is_healthy:
            logger.info("Replica %s is back", replica.url)
            replica.is_healthy = True

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.probe(client, r) for r in self.replicas))

    def start(self, client: httpx.AsyncClient) -> None:
        """Probe every `health_interval` seconds until `shutdown()`."""

        async def loop() -> None:
            while True:
                await self.probe_all(client)
                await asyncio.sleep(self.health_interval)

        self._health_task = asyncio.create_task(loop())

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
