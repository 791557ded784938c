"""HTTP errors in the OpenAI format: `{"error": {"message", "type", "param", "code"}}`.

Maps every error a client can provoke to its status (400 bad field, 401 key, 404 model or route,
413 body size, 503 queue full) so that bad input never surfaces as a 500; anything else is a 500
whose details go to the log, not to the client.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.async_engine import EngineDeadError, QueueFullError
from tandem.errors import InvalidRequestError
from tandem.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("tandem.server")

RETRY_AFTER_S = 1
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          503: "server_overloaded"}


class APIError(Exception):
    """An error with its HTTP status, raised by the serving code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "internal_error"), param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def to_api_error(e: BaseException) -> APIError:
    """The HTTP meaning of an exception raised while serving a request."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), e.field, "invalid_value")
    if isinstance(e, QueueFullError):
        return APIError(503, f"server busy: {e}; retry later", None, "queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), None, "engine_dead")
    log.error("internal error while serving a request", exc_info=e)
    return APIError(500, "internal server error", None, "internal_error")


def api_error_response(e: BaseException) -> JSONResponse:
    err = to_api_error(e)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
    return error_response(err.status, err.message, err.param, err.code, headers)


def param_path(loc: Sequence[str | int]) -> str | None:
    """A validation error location as a field path: ("body", "messages", 0, "content") -> messages[0].content."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD.match(str(part)) and part not in _UNION_MEMBERS:   # skip "list[int]", "NamedToolChoice"
            path += f".{part}" if path else str(part)
    return path or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = param_path(first.get("loc", ()))
    if param is None:
        return f"invalid request body: {first.get('msg')}", None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{param}: {first.get('msg')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(QueueFullError)
    async def _busy(request: Request, exc: QueueFullError) -> JSONResponse:
        return api_error_response(exc)
