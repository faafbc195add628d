"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Handlers raise APIError; engine and validation errors are mapped here, so each endpoint says
nothing about status codes. The engine's ValueErrors read "field: what is wrong", which gives
`param`.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import EngineUnavailableError, QueueFullError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

RETRY_AFTER_SECONDS = 1


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
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def invalid_request(error: ValueError) -> APIError:
    """400 for an engine or SamplingParams ValueError, naming the field it starts with."""
    message = str(error)
    match = re.match(r"([a-z_]+): ", message)
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
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(error), type="server_error", code="unavailable")


def to_api_error(error: Exception) -> APIError:
    """The APIError for what generation can raise; anything else is a 500."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFullError):
        return queue_full(error)
    if isinstance(error, EngineUnavailableError):
        return unavailable(error)
    if isinstance(error, ValueError):
        return invalid_request(error)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {error!r}", type="server_error")


def error_json(error: APIError) -> str:
    return ErrorResponse(error=error.info).model_dump_json()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        ErrorResponse(error=error.info).model_dump(), status_code=error.status, headers=error.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, error: Exception) -> JSONResponse:
        return error_response(to_api_error(error))

    async def on_validation_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(APIError(HTTPStatus.BAD_REQUEST, message, param=where[0] if where else None))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    for error_type in (QueueFullError, EngineUnavailableError, ValueError):
        app.add_exception_handler(error_type, on_api_error)
