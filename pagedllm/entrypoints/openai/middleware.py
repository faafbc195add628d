"""ASGI middleware that runs before any route: the API key, and a bound on body size.

Both answer in OpenAI's error shape, before the body is read (a wrong key) or while it is read
(a body over the bound, whether it announced its length or streams in chunks).
"""

from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import APIError, error_response, http_error

GUARDED_PATHS = ("/v1/", "/tokenize", "/detokenize", "/stats")
"""What the API key guards (by prefix): the API, tokenization (it is the model's tokenizer), /stats
(it names callers) and /stats/kv_blocks (request ids and callers by block). /health, /version,
/metrics (open as vLLM's: with a key set it leaves callers out, prometheus.caller_labels_on),
/dashboard (a page that asks for the key) and /static (its chart library) stay open."""


class APIKeyMiddleware:
    """401 for a guarded call without `Authorization: Bearer <key>` (the scheme in any case, as
    RFC 7235 says), before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.api_key):
                error = APIError(
                    HTTPStatus.UNAUTHORIZED,
                    "Missing or wrong API key: send `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLargeError(HTTPException):
    """Raised from inside `receive`: FastAPI passes HTTPExceptions through its body parsing."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is over {max_bytes:,} bytes (--max-request-body-bytes)",
        )


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon as the
    bytes received pass the bound (nothing more is read)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            too_large = BodyTooLargeError(self.max_bytes)
            await error_response(http_error(too_large.status_code, too_large.detail))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
