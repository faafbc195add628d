"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Handlers raise APIError; engine and validation errors are mapped here, so each endpoint says
nothing about status codes. The engine's ValueErrors read "field: what is wrong", which gives
`param`. Every error the app can produce has this shape: unknown routes and methods, bodies that
do not parse, and anything unexpected (a 500, logged with its traceback). A message quotes at most
MAX_MESSAGE_CHARS of itself: a bad value echoed whole (a 2 MB stop list) would make its own
error as large as the body that caused it.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedllm import limits
from pagedllm.engine.errors import (
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
)
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
MAX_MESSAGE_CHARS = 500
MAX_QUOTED_CHARS = 100


class APIError(Exception):
    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A message may quote the client's text; a lone surrogate in it must not break the reply.
        message = _capped(message, MAX_MESSAGE_CHARS).encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def quoted(value: object) -> str:
    """repr(value) for an error message, cut to MAX_QUOTED_CHARS (saying how long it was)."""
    return _capped(repr(value), MAX_QUOTED_CHARS)


def _capped(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text):,} characters)"


def invalid_request(error: Exception) -> APIError:
    """400 for a ValueError (engine, SamplingParams) or a request rejected in the engine, naming the
    field its message starts with."""
    message = str(error)
    match = re.match(r"([a-z_]+)[:.]", message)
    return APIError(HTTPStatus.BAD_REQUEST, message, param=match.group(1) if match else None)


def queue_full(error: QueueFullError) -> APIError:
    return APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        str(error),
        type="server_overloaded",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def unavailable(error: EngineUnavailableError) -> APIError:
    """503 while shutting down (or after the engine died): retry, here after a restart or elsewhere."""
    return APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        str(error),
        type="server_error",
        code="unavailable",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def to_api_error(error: Exception) -> APIError:
    """The APIError for what generation can raise; anything else is a 500."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFullError):
        return queue_full(error)
    if isinstance(error, EngineUnavailableError):
        return unavailable(error)
    if isinstance(error, RequestRejectedError):
        return invalid_request(error)
    if isinstance(error, RequestFailedError):
        return APIError(
            HTTPStatus.INTERNAL_SERVER_ERROR, str(error), type="server_error", code="request_failed"
        )
    if isinstance(error, ValueError):
        return invalid_request(error)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {error!r}", type="server_error")


def error_json(error: APIError) -> str:
    return ErrorResponse(error=error.info).model_dump_json()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        ErrorResponse(error=error.info).model_dump(), status_code=error.status, headers=error.headers
    )


def http_error(status: int, detail: str) -> APIError:
    """An HTTP-level error (unknown route, wrong method, a body that is not JSON, too large)."""
    return APIError(
        HTTPStatus(status),
        detail,
        type="invalid_request_error" if status < 500 else "server_error",
        code=HTTPStatus(status).phrase.lower().replace(" ", "_"),
    )


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, error: Exception) -> JSONResponse:
        return error_response(to_api_error(error))

    async def on_http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        detail = error.detail
        if error.status_code in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED):
            detail = f"{detail}: {request.method} {request.url.path}"
        elif error.status_code == HTTPStatus.BAD_REQUEST and error.__cause__ is not None:
            # FastAPI's "There was an error parsing the body": say what was wrong with it
            detail = f"the body is not valid JSON in UTF-8 ({type(error.__cause__).__name__})"
            if isinstance(error.__cause__, RecursionError):  # as limits.check_text_and_depth says it
                detail = limits.TOO_DEEP
        return error_response(http_error(error.status_code, str(detail)))

    async def on_unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(to_api_error(error))

    async def on_validation_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if not where:  # a check of the whole body; its message starts with the field's path
            return error_response(invalid_request(ValueError(message)))
        message = f"{'.'.join(where)}: {message}"
        return error_response(APIError(HTTPStatus.BAD_REQUEST, message, param=where[0]))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    for error_type in (QueueFullError, EngineUnavailableError, RequestFailedError, ValueError):
        app.add_exception_handler(error_type, on_api_error)
    app.add_exception_handler(Exception, on_unexpected_error)
