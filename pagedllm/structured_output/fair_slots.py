"""FairSlots: a fixed number of places (the compile pool's processes), handed out so that no one
client holds them all.

A client holds at most `max_per_client` places at once; a request over its client's share waits
while another client's request takes the free place. Waiters are served first come, first served
among those under their share, so a client's queue of slow grammars never stands in front of
another client's regex. Invariant (kept by `_dispatch` after every change): while a place is free,
no waiter is under its share.

The client is whatever the caller names (the server: the request's `user`). A request that names
none (`None`) has no share: it cannot be told from another client's, and putting all of them in
one share would let one unnamed runaway delay every other unnamed request, which two processes
exist to prevent.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairSlots(Generic[T]):
    """Places holding a T or None (a place with nothing in it yet). Event loop only."""

    def __init__(self, num_places: int, *, max_per_client: int) -> None:
        if num_places < 1 or max_per_client < 1:
            raise ValueError(
                f"FairSlots needs num_places and max_per_client >= 1, got {num_places}, {max_per_client}"
            )
        self.max_per_client = max_per_client
        self._free: list[T | None] = [None] * num_places  # last in, first out: a filled place first
        self._held: Counter[str | None] = Counter()
        self._waiters: deque[tuple[str | None, asyncio.Future[T | None]]] = deque()
        self._error: BaseException | None = None

    async def take(self, client: str | None) -> T | None:
        """A place's content, once a place is free and `client` is under its share; it is the
        caller's until `give_back`. Raises the error `close` was given, at once or when it comes."""
        if self._error is not None:
            raise self._error
        if self._free and self._is_under_share(client):
            self._held[client] += 1
            return self._free.pop()
        waiter: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        self._waiters.append((client, waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.give_back(client, waiter.result())  # handed a place as it went: pass it on
            else:
                self._forget(waiter)
            raise

    def give_back(self, client: str | None, item: T | None) -> None:
        """Return a place `client` took, with what it now holds (None: nothing)."""
        if self._error is not None:
            return
        self._held[client] -= 1
        if not self._held[client]:
            del self._held[client]
        self._free.append(item)
        self._dispatch()

    def close(self, error: BaseException) -> None:
        """Every waiter, and every later `take`, raises `error`."""
        self._error = error
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _dispatch(self) -> None:
        """Hand free places to the first waiters under their share."""
        while self._free:
            chosen = next(
                (entry for entry in self._waiters if not entry[1].done() and self._is_under_share(entry[0])),
                None,
            )
            if chosen is None:
                return
            self._waiters.remove(chosen)
            client, waiter = chosen
            self._held[client] += 1
            waiter.set_result(self._free.pop())

    def _is_under_share(self, client: str | None) -> bool:
        return client is None or self._held[client] < self.max_per_client

    def _forget(self, waiter: asyncio.Future[T | None]) -> None:
        for entry in self._waiters:
            if entry[1] is waiter:
                self._waiters.remove(entry)
                return
