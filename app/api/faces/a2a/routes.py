"""The A2A routes (FACES.md N-01, N-02): the agent card, the JSON-RPC endpoint and the HTTP+JSON
binding, each in 1.0 and, through the SDK's compatibility layer, 0.3.

- ``GET /.well-known/agent-card.json`` (and ``/.well-known/agent.json``): the card, public;
- ``POST /a2a`` (and ``/a2a/``): JSON-RPC 2.0, the 1.0 methods (``SendMessage``, ...) and the 0.3
  ones (``message/send``, ...);
- ``/a2a/rest/...``: HTTP+JSON (``POST /a2a/rest/message:send``, ``GET /a2a/rest/tasks/{id}``, ...),
  0.3's under ``/a2a/rest/v1/...``.

The SDK (``card``, ``bindings``) is loaded on the first request that needs it, not with the app: a
worker that never serves A2A never pays for its server modules and protobuf types. The binding's
own routes (``bindings.Bindings.rest``) sit behind one route over ``/a2a/rest...`` that hands the
request on; they answer a wrong method (405) and an unknown path (404) as the app's own router
would, and redirect a trailing slash the same way. The protocol routes stay out of the OpenAPI
document: the card describes them, and their bodies are the protocol's.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.api.faces.a2a.paths import CARD_PATH, JSONRPC_PATH, LEGACY_CARD_PATH, REST_PATH

if TYPE_CHECKING:
    from app.api.faces.a2a.bindings import Bindings

router = APIRouter(tags=["a2a"])


@cache
def _bindings() -> Bindings:
    # Once per process. The build never awaits, so an event loop's requests cannot interleave in it;
    # two threads' first requests (apps in threads, as tests run them) may both build: either serves.
    from app.api.faces.a2a.bindings import build_bindings

    return build_bindings()


async def _jsonrpc(request: Request) -> Response:
    return await _bindings().jsonrpc(request)


class _RestBinding:
    """The ASGI app behind ``/a2a/rest...``: the binding's routes, matched on the whole path."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["path_params"] = {}  # this route's own ``{rest}``: the binding's routes match theirs
        await _bindings().rest(scope, receive, send)


for path in (JSONRPC_PATH, JSONRPC_PATH + "/"):
    router.add_route(path, _jsonrpc, methods=["POST"], include_in_schema=False)
# No slash before ``{rest}``: ``/a2a/rest`` itself is the binding's to answer (404), as before.
router.routes.append(Route(REST_PATH + "{rest:path}", _RestBinding(), include_in_schema=False))


async def _card(request: Request) -> Response:
    from app.api.faces.a2a.card import card_response

    return card_response(request.app.state.services, request)


_CARD_DOC = {
    200: {
        "description": "the A2A agent card (FACES.md N-01), with ETag and Cache-Control",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}

for card_path, summary in (
    (CARD_PATH, "A2A agent card"),
    (LEGACY_CARD_PATH, "A2A agent card with 0.3 fields"),
):
    router.add_api_route(
        card_path,
        _card,
        methods=["GET"],
        response_model=None,
        responses=_CARD_DOC,  # type: ignore[arg-type]
        summary=summary,
        name=summary.replace(" ", "_").lower(),
    )
