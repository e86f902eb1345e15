"""The A2A protocol bindings (FACES.md N-02): the SDK's JSON-RPC dispatcher and HTTP+JSON routes,
each in 1.0 and, through the SDK's compatibility layer, 0.3, with the service around them.

The SDK's dispatchers parse, negotiate the version (``A2A-Version``, or the ``A2A-Version`` query
parameter), call ``RunsRequestHandler`` and shape errors; around them, each route authenticates
the caller as every other route does (an API key or an access token; a refusal is the service's
``401`` with its challenge), refuses bodies that are not UTF-8 JSON in the binding's own error
shape (the SDK would answer them as internal errors), and answers a refusal of the service (a full
queue, a worker shutting down, an outage) with its status and ``Retry-After`` on HTTP+JSON.

This module loads the SDK's server side; ``routes`` builds it on the first protocol request.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.jsonrpc_models import JSONParseError
from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.server.routes.common import DefaultServerCallContextBuilder, ServerCallContextBuilder
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from a2a.server.routes.rest_routes import create_rest_routes
from a2a.utils.constants import A2A_JSON_MEDIA_TYPE, VERSION_HEADER
from a2a.utils.error_handlers import build_rest_error_payload
from a2a.utils.errors import ContentTypeNotSupportedError, InvalidRequestError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from app.api.faces.a2a.handler import RunsRequestHandler
from app.api.faces.a2a.paths import REST_PATH
from app.container import Services
from app.errors import ServiceError

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Bindings:
    jsonrpc: Endpoint
    """``POST /a2a`` and ``/a2a/``."""
    rest: Router
    """``/a2a/rest/...``: the SDK's routes, in its order, each behind the service's checks."""


class CallContext(ServerCallContextBuilder):
    """The SDK's call context, with what ``RunsRequestHandler`` needs: the services, the caller
    (authenticated by the route before the SDK sees the request) and the request itself."""

    def __init__(self) -> None:
        self._default = DefaultServerCallContextBuilder()

    def build(self, request: Request) -> ServerCallContext:
        context = self._default.build(request)
        headers = context.state["headers"]
        version = request.query_params.get(VERSION_HEADER)
        if version and not headers.get(VERSION_HEADER.lower()):
            headers[VERSION_HEADER.lower()] = version  # A2A 3.6.1: a query parameter will do
        context.state["services"] = request.app.state.services
        context.state["owner"] = request.state.a2a_owner
        context.state["request"] = request
        return context


async def _authenticated(request: Request) -> None:
    services: Services = request.app.state.services
    request.state.a2a_owner = await services.auth.owner(request.headers.get("authorization"))


async def _json_body(request: Request) -> Any:
    """The body as JSON, or ``ValueError`` (not UTF-8, not JSON, nested too deeply)."""
    body = await request.body()
    try:
        return json.loads(body.decode("utf-8")) if body else None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


def _rpc_id(value: Any) -> str | int | None:
    return value if isinstance(value, str | int) and not isinstance(value, bool) else None


def _refusal(request: Request) -> ServiceError | None:
    refused = getattr(request.state, "a2a_refused", None)
    return refused if isinstance(refused, ServiceError) else None


_REFUSAL_STATUS = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


def _rest(endpoint: Endpoint, *, has_body: bool) -> Endpoint:
    async def route(request: Request) -> Response:
        await _authenticated(request)
        if has_body:
            try:
                await _json_body(request)
            except ValueError as exc:
                payload = build_rest_error_payload(InvalidRequestError(f"the body is not JSON: {exc}"))
                return JSONResponse(payload, status_code=400)
        response = await endpoint(request)
        if response.headers.get("content-type") == A2A_JSON_MEDIA_TYPE:
            # A2A 1.0 (11.1) names application/json; the SDK follows a later draft.
            response.headers["content-type"] = "application/json"
        refused = _refusal(request)
        if refused is not None and response.status_code >= 500:
            payload = {
                "error": {
                    "code": refused.status,
                    "status": _REFUSAL_STATUS.get(refused.status, "UNAVAILABLE"),
                    "message": refused.message,
                    "details": [
                        {
                            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                            "reason": refused.code.upper(),
                            "domain": "agentstream",
                            "metadata": {},
                        }
                    ],
                }
            }
            return JSONResponse(payload, status_code=refused.status, headers=dict(refused.headers))
        return response

    return route


def _jsonrpc(dispatcher: JsonRpcDispatcher) -> Endpoint:
    async def route(request: Request) -> Response:
        await _authenticated(request)
        body: Any = None
        error: JSONParseError | None = None
        try:
            body = await _json_body(request)
        except ValueError as exc:
            error = JSONParseError(message=str(exc))
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media and media != "application/json" and not media.endswith("+json"):
            request_id = body.get("id") if isinstance(body, dict) else None
            refused = ContentTypeNotSupportedError(f"send Content-Type: application/json, not {media}")
            return JSONResponse(build_error_response(_rpc_id(request_id), refused))
        if error is not None:
            return JSONResponse(build_error_response(None, error))
        return await dispatcher.handle_requests(request)

    return route


def build_bindings() -> Bindings:
    handler = RunsRequestHandler()
    context = CallContext()
    dispatcher = JsonRpcDispatcher(handler, context_builder=context, enable_v0_3_compat=True)
    rest: list[Route] = []
    for route in create_rest_routes(
        handler, context_builder=context, enable_v0_3_compat=True, path_prefix=REST_PATH
    ):
        # Tenants (the SDK's ``/{tenant}/...`` mount) are not used: one service, one agent.
        if isinstance(route, Route) and route.methods:
            methods = sorted(m for m in route.methods if m != "HEAD")
            has_body = bool({"POST", "PUT", "PATCH"} & set(methods))
            rest.append(Route(route.path, _rest(route.endpoint, has_body=has_body), methods=methods))
    return Bindings(jsonrpc=_jsonrpc(dispatcher), rest=Router(routes=rest))
