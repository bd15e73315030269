"""The service's error answers: every error is ``{"error": {"type", "message", "status"}}`` JSON,
counted in the ``prefixcache_http_errors`` metric by endpoint and status.

A typed error (``PrefixCacheError``) gets the status its kind names (``status_of``), including the
service's own ``TooManyRequestsError`` (429), ``BodyTimeoutError`` (408) and
``CounterfactualUnavailableError`` (409); an unknown
path (404) or a wrong method (405) answers in the same shape; a body nested too deeply for any
step that reads it is a 400; anything unforeseen is a 500 in the same shape, counted too. A
client that goes away before its body has arrived is not an error: it is counted in
``prefixcache_aborted_requests`` and answered 499 (nginx's "client closed request"), which no one
reads.
"""

from __future__ import annotations

import math
from http import HTTPStatus

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from prefixcache.errors import (
    ConfigError,
    DuplicateRequestError,
    MalformedJSONError,
    NoHealthyReplicaError,
    PayloadTooLargeError,
    PrefixCacheError,
    UnknownNamespaceError,
    UnknownReplicaError,
    UnknownRequestError,
)
from prefixcache.fleet.whatif.counterfactual_replay import CounterfactualUnavailableError


class TooManyRequestsError(PrefixCacheError, RuntimeError):
    """A key is over its rate limit or its cap on in-flight request ids (HTTP 429); retry after
    ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BodyTimeoutError(PrefixCacheError, TimeoutError):
    """The client did not send the whole request body within the read timeout (HTTP 408)."""


_STATUS: tuple[tuple[type[PrefixCacheError], int], ...] = (
    (TooManyRequestsError, 429),
    (BodyTimeoutError, 408),
    (PayloadTooLargeError, 413),
    (UnknownNamespaceError, 404),
    (UnknownRequestError, 404),
    (UnknownReplicaError, 404),
    (DuplicateRequestError, 409),
    (CounterfactualUnavailableError, 409),
    (NoHealthyReplicaError, 503),
    (MalformedJSONError, 400),
    (ConfigError, 500),
)
_HTTP_STATUSES = {int(status) for status in HTTPStatus}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client gave up on


def error_response(status: int, kind: str, message: str) -> Response:
    """The JSON error answer every endpoint gives."""
    body = {"error": {"type": kind, "message": message, "status": status}}
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def status_of(exc: PrefixCacheError) -> int:
    """HTTP status for a typed error (``_STATUS``); 422 for any other bad input."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 422


async def typed_error(request: Request, exc: PrefixCacheError) -> Response:
    """The answer to a ``PrefixCacheError`` raised by a handler (with ``Retry-After`` when no
    replica takes routes now)."""
    status = status_of(exc)
    request.app.state.service.metrics.errors.labels(request.url.path, str(status)).inc()
    response = error_response(status, type(exc).__name__, str(exc))
    if isinstance(exc, NoHealthyReplicaError | TooManyRequestsError):
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, BodyTimeoutError):
        response.headers["Connection"] = "close"  # the rest of the body may never come
    return response


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """The answer to an HTTP error of the framework: unknown paths (404) and wrong methods (405)
    answer in the same JSON shape."""
    status = exc.status_code
    path = request.url.path
    known = any(getattr(route, "path", None) == path for route in request.app.routes)
    # an unknown path is not a label of its own: scanners would grow the metrics forever
    errors = request.app.state.service.metrics.errors
    errors.labels(path if known else "(unknown)", str(status)).inc()
    kind = HTTPStatus(status).phrase.replace(" ", "") if status in _HTTP_STATUSES else "HTTP"
    response = error_response(status, kind, f"{request.method} {request.url.path}: {exc.detail}")
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def nesting_error(request: Request, exc: RecursionError) -> Response:
    """A body nested so deeply that reading it ran out of stack, at whatever step: a 400."""
    request.app.state.service.metrics.errors.labels(request.url.path, "400").inc()
    return error_response(400, "MalformedJSONError", "request body is nested too deeply")


async def aborted_request(request: Request, exc: ClientDisconnect) -> Response:
    """A client that disconnected while its body was read: counted, and answered to no one."""
    request.app.state.service.metrics.aborted.labels(request.url.path).inc()
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def unexpected_error(request: Request, exc: Exception) -> Response:
    """Anything no other handler answers: a JSON 500, counted like every other error."""
    request.app.state.service.metrics.errors.labels(request.url.path, "500").inc()
    return error_response(500, "InternalError", f"{type(exc).__name__} while serving the request")
