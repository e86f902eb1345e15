"""A server span around each HTTP request (``POST /api/conversations/{conversation_id}/runs``),
continuing the caller's trace when the request carries a ``traceparent``: the span of a run started
by the request is its child. Health checks, metrics and static files are left out."""

from __future__ import annotations

from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

Scope = dict[str, Any]
Message = dict[str, Any]

UNTRACED = ("/healthz", "/readyz", "/metrics", "/static/", "/favicon.ico")


class ServerSpans:
    """Pure ASGI middleware (a ``BaseHTTPMiddleware`` would run the route in another context).
    Its tracer is the app's (``services.tracing``), made when the app starts."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path: str = scope.get("path", "")
        tracer = _tracer(scope)
        if tracer is None or scope["type"] != "http" or path == "/" or path.startswith(UNTRACED):
            await self.app(scope, receive, send)
            return
        method: str = scope.get("method", "GET")
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        # The query is left out: a browser's stream request carries its key there (access_token).
        attributes = {
            "http.request.method": method,
            "url.path": path,
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        span = tracer.start_span(
            method, context=propagate.extract(carrier), kind=SpanKind.SERVER, attributes=attributes
        )

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_attribute("error.type", str(status))
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            try:
                await self.app(scope, receive, send_traced)
            except Exception as exc:
                span.set_attribute("error.type", type(exc).__name__)
                span.set_status(Status(StatusCode.ERROR))
                raise
            finally:
                route = getattr(scope.get("route"), "path", None)
                if route:
                    span.set_attribute("http.route", route)
                    span.update_name(f"{method} {route}")


def _tracer(scope: Scope) -> Tracer | None:
    services = getattr(getattr(scope.get("app"), "state", None), "services", None)
    return services.tracing.tracer if services is not None else None
