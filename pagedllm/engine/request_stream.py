"""RequestStream: one API request's choices as they grow, on the event loop. AsyncLLM's engine
thread hands each step's outputs over (one call_soon_threadsafe per step); a stream keeps only
the latest cumulative output per choice, so a slow client skips steps instead of queueing them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedllm.outputs import RequestOutput


class RequestStream:
    """The choices of one API request, as they grow: `async for updates in stream` yields
    {choice index: latest cumulative RequestOutput} until every choice has finished.

    Lives on the event loop. `close()` must be called when the handler is done (a finally):
    it aborts the choices still running, e.g. when the client went away.
    """

    def __init__(self, abort: Callable[[list[str]], None], req_ids: list[str]) -> None:
        """abort: AsyncLLM.abort, which `close()` calls with the choices still running."""
        self.req_ids = req_ids
        self._abort = abort
        self._latest: dict[int, RequestOutput] = {}
        self._event = asyncio.Event()
        self._unfinished = set(range(len(req_ids)))
        self._error: BaseException | None = None

    def _put(self, index: int, output: RequestOutput) -> None:
        self._latest[index] = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> dict[int, RequestOutput]:
        while not self._latest:
            if not self._unfinished:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()
        updates, self._latest = self._latest, {}
        for index, output in updates.items():
            if output.finished:
                self._unfinished.discard(index)
        return updates

    async def collect(self) -> list[RequestOutput]:
        """Wait for every choice to finish; their final outputs in choice order."""
        final: dict[int, RequestOutput] = {}
        async for updates in self:
            final.update(updates)
        return [final[i] for i in range(len(self.req_ids))]

    def close(self) -> None:
        if self._unfinished:
            self._abort([self.req_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()
