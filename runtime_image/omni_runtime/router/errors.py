"""Router errors, and the one function that turns any exception into an OpenAI-shaped error response.

    {"error": {"message": "...", "type": "BadRequestError", "param": "size", "code": 400}}

`type` and `code` follow vLLM's OpenAI server (the exception class name and the HTTP status).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

__all__ = [
    "BadRequest",
    "ClientGone",
    "EngineFailed",
    "NotFound",
    "OmniError",
    "Overloaded",
    "RequestTimedOut",
    "RequestTooLarge",
    "RouterDraining",
    "StageLost",
    "StageUnavailable",
    "Unauthorized",
    "error_body",
    "error_response",
    "from_stage_failure",
]

log = logging.getLogger(__name__)


class OmniError(Exception):
    """An error the router reports to the client. Subclasses fix the status and the OpenAI type."""

    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequest(OmniError):
    status, type = 400, "BadRequestError"


class Unauthorized(OmniError):
    """No API key, or a wrong one; the `WWW-Authenticate` header names the scheme (RFC 6750)."""

    status, type = 401, "AuthenticationError"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="omnikube"'})


class NotFound(OmniError):
    status, type = 404, "NotFoundError"


class RequestTooLarge(OmniError):
    status, type = 413, "RequestTooLargeError"


class Overloaded(OmniError):
    """Admission is full (in flight and queue); the client should retry after `retry_after` seconds."""

    status, type = 429, "RateLimitError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class EngineFailed(OmniError):
    """A stage's engine failed on the request."""

    status, type = 500, "InternalServerError"


class StageLost(OmniError):
    """The replica running part of the request went away (connection lost, stopped answering)."""

    status, type = 502, "BadGatewayError"


class StageUnavailable(OmniError):
    """No ready replica of a stage (or it is still loading): retry later."""

    status, type = 503, "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class RouterDraining(OmniError):
    """The router is shutting down and its drain period ended before the request did: retry it."""

    status, type = 503, "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class ClientGone(OmniError):
    """The client disconnected before the answer (nginx's 499; nobody reads it)."""

    status, type = 499, "ClientClosedRequest"


class RequestTimedOut(OmniError):
    status, type = 504, "TimeoutError"


def from_stage_failure(kind: str, message: str) -> OmniError:
    """The router error for a stage's `Failed` message kind."""
    if kind == "invalid_request":
        return BadRequest(message)
    if kind == "unavailable":
        return StageUnavailable(message)
    return EngineFailed(message)


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(exc: BaseException, routes: Sequence[str] = ()) -> JSONResponse:
    """The OpenAI-shaped response for any exception raised while serving a request; a 404 lists `routes`
    (the paths the app serves)."""
    if isinstance(exc, OmniError):
        status, type_, message, param, headers = exc.status, exc.type, exc.message, exc.param, exc.headers
    elif isinstance(exc, RequestValidationError | ValidationError):
        status, type_, headers = 400, "BadRequestError", {}
        message, param = _validation_message(exc)
    elif isinstance(exc, json.JSONDecodeError):
        status, type_, param, headers = 400, "BadRequestError", None, {}
        message = f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    elif isinstance(exc, StarletteHTTPException):
        status, param, headers = exc.status_code, None, dict(exc.headers or {})
        type_ = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}.get(
            status, "HTTPError"
        )
        message = str(exc.detail)
        if status == 404:
            message = "no such route; this server offers " + ", ".join(routes) if routes else "no such route"
    else:
        log.exception("unexpected error while serving a request", exc_info=exc)
        status, type_, param, headers = 500, "InternalServerError", None, {}
        message = f"internal error: {type(exc).__name__}: {exc}"
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"the request body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
        where = ".".join(loc)
        param = param or (where or None)
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "missing":
            parts.append(f"{where}: field required")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
            parts.append(f"{where}: {msg}{shown}" if where else msg)
    return "; ".join(parts) or "invalid request", param
