"""What the server's front end (async_engine.py) raises to a request, in a module of their own:
the HTTP layer maps them to status codes (entrypoints/openai/errors.py), and the router, which
serves no model, shares that layer without importing the engine (torch among it)."""

from __future__ import annotations


class QueueFullError(Exception):
    """The waiting queue would go over --max-queue-len; the client should retry later."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or has died; no request can be served."""


class RequestFailedError(Exception):
    """This request failed inside the engine (the engine itself went on serving the others)."""


class RequestRejectedError(RequestFailedError):
    """This request failed inside the engine because of what it asked for (the client's fault)."""
