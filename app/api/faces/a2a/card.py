"""The agent card (FACES.md N-01): who the agent is, where it listens, what it can and how to sign in.

Built per request from the settings (name, description, models as skills, the service's auth) and
the service's public URL (``PUBLIC_BASE_URL``, else the request's scheme, host and port), as the
SDK's ``AgentCard``; served with a weak ``ETag`` over its content and ``Cache-Control``. At
``/.well-known/agent-card.json`` it is the 1.0 card (1.0's schema allows no other field); at
``/.well-known/agent.json`` the SDK's ``agent_card_to_dict`` adds the 0.3 fields (``url``,
``preferredTransport``, ...) that older clients read, from the interfaces declared for 0.3.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentProvider,
    AgentSkill,
    HTTPAuthSecurityScheme,
    OpenIdConnectSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol
from google.protobuf import json_format
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app import __version__
from app.api.faces.a2a.paths import JSONRPC_PATH, LEGACY_CARD_PATH, REST_PATH
from app.container import Services

CACHE_CONTROL = "public, max-age=300"
"""Five minutes: a card changes with a deploy (settings, models, tools), and a client that holds a
stale one still reaches every route it names."""

INPUT_MODES = ["text/plain", "application/json"]
OUTPUT_MODES = ["text/plain"]


def base_url(services: Services, request: Request) -> str:
    configured = services.settings.public_base_url
    if configured:
        return configured
    return str(request.base_url).rstrip("/")


def _security(services: Services) -> tuple[dict[str, SecurityScheme], list[SecurityRequirement]]:
    """The card's schemes: none in single-user mode; a bearer API key with ``API_KEYS``; the
    identity provider's tokens (OpenID Connect discovery, or a JWT bearer) with sign-in on."""
    settings = services.settings
    schemes: dict[str, SecurityScheme] = {}
    if settings.owner_keys():
        schemes["apiKey"] = SecurityScheme(
            http_auth_security_scheme=HTTPAuthSecurityScheme(
                scheme="Bearer", description="An API key from the service's API_KEYS, as a bearer token."
            )
        )
    if settings.sign_in:
        if settings.auth_oidc_issuer:
            discovery = settings.auth_oidc_issuer.rstrip("/") + "/.well-known/openid-configuration"
            schemes["signIn"] = SecurityScheme(
                open_id_connect_security_scheme=OpenIdConnectSecurityScheme(
                    open_id_connect_url=discovery,
                    description="An access token (JWT) of the identity provider, as a bearer token.",
                )
            )
        else:
            schemes["signIn"] = SecurityScheme(
                http_auth_security_scheme=HTTPAuthSecurityScheme(
                    scheme="Bearer",
                    bearer_format="JWT",
                    description="An access token (JWT) of the identity provider, as a bearer token.",
                )
            )
    # Any one of them will do: a requirement each (the list is an OR).
    requirements = [SecurityRequirement(schemes={name: StringList()}) for name in schemes]
    return schemes, requirements


def _skills(services: Services) -> list[AgentSkill]:
    """A skill per configured model (``GET /api/models``): the same agent on each. A new context
    picks one with the request's ``metadata.agent.model``."""
    tools = ", ".join(services.tools.names())
    skills = []
    for model in services.models.public():
        name = str(model["name"])
        default = " (the default)" if model["default"] else ""
        skills.append(
            AgentSkill(
                id=name,
                name=f"Agent on {name}{default}",
                description=(
                    f"A ReAct agent on the model {name!r} that plans, calls tools ({tools}) and "
                    "streams its answer; tool calls that need approval wait for a person "
                    "(input-required)."
                ),
                tags=["agent", "tools", "durable"],
                examples=["What is 17*23 and what time is it in Tokyo?"],
                input_modes=INPUT_MODES,
                output_modes=OUTPUT_MODES,
            )
        )
    return skills


def agent_card(services: Services, request: Request) -> AgentCard:
    base = base_url(services, request)
    settings = services.settings
    schemes, requirements = _security(services)
    interfaces = [
        AgentInterface(url=base + url, protocol_binding=binding.value, protocol_version=version)
        for version in (PROTOCOL_VERSION_1_0, PROTOCOL_VERSION_0_3)
        for binding, url in (
            (TransportProtocol.JSONRPC, JSONRPC_PATH),
            (TransportProtocol.HTTP_JSON, REST_PATH),
        )
    ]
    card = AgentCard(
        name=settings.a2a_agent_name,
        description=settings.a2a_agent_description,
        version=__version__,
        supported_interfaces=interfaces,
        provider=AgentProvider(organization=settings.a2a_agent_name, url=base),
        # Push notification configs (N-06): delivered through the webhooks' durable outbox.
        capabilities=AgentCapabilities(streaming=True, push_notifications=True, extended_agent_card=False),
        security_requirements=requirements,
        default_input_modes=INPUT_MODES,
        default_output_modes=OUTPUT_MODES,
        skills=_skills(services),
    )
    for name, scheme in schemes.items():
        card.security_schemes[name].CopyFrom(scheme)
    return card


def card_json(card: AgentCard, *, legacy: bool) -> tuple[dict[str, Any], str]:
    """The card as JSON and its weak ``ETag``: as 1.0 has it, or (``legacy``) with the 0.3 fields
    (``url``, ``preferredTransport``, ``additionalInterfaces``, ``protocolVersion``) that the SDK
    adds for older clients, which 1.0's schema does not allow."""
    body = agent_card_to_dict(card) if legacy else json_format.MessageToDict(card)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return body, f'W/"{digest[:32]}"'


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 13.1.2: weak comparison, ``*`` or any of a list."""
    if not if_none_match:
        return False
    candidates = [c.strip() for c in if_none_match.split(",")]
    return "*" in candidates or any(c.removeprefix("W/") == etag.removeprefix("W/") for c in candidates)


def card_response(services: Services, request: Request) -> Response:
    """The card the request's path names, or ``304`` when the client's copy is still the same."""
    card = agent_card(services, request)
    body, etag = card_json(card, legacy=request.url.path == LEGACY_CARD_PATH)
    headers = {"ETag": etag, "Cache-Control": CACHE_CONTROL}
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    return JSONResponse(body, headers=headers)
