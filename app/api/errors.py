"""Every error becomes ``{"error": {"code", "message"}}`` with the right status, mapped here once."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.db.errors import ConversationNotFoundError, database_unreachable
from app.errors import ServiceError
from app.streaming.bus import BusUnavailableError

log = logging.getLogger("app.api")


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _describe_validation(errors: list[Any], content_type: str) -> tuple[str, str, int]:
    for err in errors:
        if err.get("type") == "json_invalid":
            return "invalid_json", "the request body is not valid JSON", 400
    if any(tuple(err.get("loc", ())) == ("body",) for err in errors):
        # The body as a whole: absent, not an object, or not sent as JSON at all (FastAPI reads
        # a body as JSON only under a JSON content type; curl -d sends a form's).
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            return "invalid_request", "the body must be JSON: send Content-Type: application/json", 422
        return "invalid_request", "the request body must be a JSON object", 422
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "invalid"))
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid_request", "; ".join(parts) or "invalid request", 422


def _undecodable(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid UTF-8 JSON"
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    return "the request body is not valid JSON"


_ALWAYS_OUTAGES: tuple[type[Exception], ...] = (
    ConnectionError,
    TimeoutError,  # PostgreSQL gave no answer within its command timeout
    RedisConnectionError,
    RedisTimeoutError,
    BusUnavailableError,
)
_OUTAGES: tuple[type[Exception], ...] = (*_ALWAYS_OUTAGES, DBAPIError, PoolTimeoutError)
"""What a request runs into while the database or Redis is restarting or does not answer
(DBAPIError only when it says the connection is gone)."""


def _is_outage(exc: Exception) -> bool:
    return isinstance(exc, _ALWAYS_OUTAGES) or database_unreachable(exc)


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", extra={"path": request.url.path}, exc_info=exc)
    return error_response(500, "internal_error", "internal error")


class InternalErrors:
    """Answers an exception no handler took with the 500 of ``_internal_error``, from inside the
    middleware it is put under (``app.api.cors``): Starlette answers it from its outermost layer,
    outside every middleware, so a browser app would see no CORS headers, only "Failed to fetch".
    An exception after the response started (a stream cut short) goes on as it came."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            await _internal_error(Request(scope), exc)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, dict(exc.headers) or None)

    @app.exception_handler(ConversationNotFoundError)
    async def _conversation_gone(_: Request, exc: ConversationNotFoundError) -> JSONResponse:
        # Deleted between the route's ownership check and its write (a concurrent DELETE).
        return error_response(404, "not_found", "conversation not found")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        code, message, status = _describe_validation(
            list(exc.errors()), request.headers.get("content-type", "")
        )
        return error_response(status, code, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:
            # FastAPI's answer to a body it could not decode at all (not UTF-8, nested too deep).
            return error_response(400, "invalid_json", _undecodable(exc.__cause__))
        codes = {404: "not_found", 405: "method_not_allowed", 413: "too_large", 400: "bad_request"}
        return error_response(
            exc.status_code,
            codes.get(exc.status_code, "http_error"),
            str(exc.detail),
            getattr(exc, "headers", None),
        )

    async def _outage(request: Request, exc: Exception) -> JSONResponse:
        if not _is_outage(exc):
            return _internal_error(request, exc)
        # A dependency restarting is no bug: the client may retry shortly (and nothing to alarm on).
        log.warning("a dependency is unreachable", extra={"path": request.url.path, "error": repr(exc)})
        return error_response(
            503,
            "unavailable",
            "the database or the event bus is unreachable; retry shortly",
            {"Retry-After": "1"},
        )

    for kind in _OUTAGES:
        app.add_exception_handler(kind, _outage)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request, exc)
