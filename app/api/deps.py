"""FastAPI dependencies as ``Annotated`` aliases: the services container and the caller's identity.

They are ``async def`` although they never await: FastAPI runs a plain ``def`` dependency in its
thread pool, which cost every request two thread hand-offs and the event loop its GIL meanwhile.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.container import Services
from app.errors import UnauthorizedError

SINGLE_USER_OWNER = "local"

# Declares the bearer scheme in the OpenAPI document; ``_bearer`` below does the parsing, so that a
# malformed header is a 401 with a message rather than silently no key.
BEARER = HTTPBearer(
    auto_error=False,
    description="An API key from API_KEYS (`owner:key,...`); any value in single-user mode.",
)
BearerDoc = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def _owner_for(services: Services, presented: str | None) -> str:
    keys = services.owner_keys
    if not presented:
        raise UnauthorizedError("missing API key: send Authorization: Bearer <key>")
    owner: str | None = None
    # Compare against every key so the time taken does not reveal which prefix matched.
    for key, who in keys.items():
        if hmac.compare_digest(key.encode(), presented.encode()):
            owner = who
    if owner is None:
        raise UnauthorizedError("invalid API key")
    return owner


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise UnauthorizedError("the Authorization header must be 'Bearer <key>'")
    return value.strip()


async def get_owner(request: Request, services: ServicesDep, _documented: BearerDoc) -> str:
    if not services.owner_keys:
        # Single-user mode authenticates nothing, so it also refuses nothing: a proxy in front
        # may well send its own Authorization header.
        return SINGLE_USER_OWNER
    return _owner_for(services, _bearer(request))


async def get_stream_owner(request: Request, services: ServicesDep, _documented: BearerDoc) -> str:
    """The stream route also accepts ``?access_token=``: an EventSource cannot set headers."""
    if not services.owner_keys:
        # Single-user mode authenticates nothing, so it also refuses nothing: a proxy in front
        # may well send its own Authorization header.
        return SINGLE_USER_OWNER
    token = _bearer(request) or request.query_params.get("access_token")
    return _owner_for(services, token)


OwnerDep = Annotated[str, Depends(get_owner)]
StreamOwnerDep = Annotated[str, Depends(get_stream_owner)]
