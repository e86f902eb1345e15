"""FastAPI dependencies as ``Annotated`` aliases: the services container and the caller's identity.

They are ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool, which cost every
request two thread hand-offs and the event loop its GIL meanwhile; and an access token may need the
identity provider's keys fetched (``app.auth``), which is awaited.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.auth import SINGLE_USER_OWNER
from app.container import Services

__all__ = ["SINGLE_USER_OWNER", "OwnerDep", "ServicesDep", "StreamOwnerDep"]

# Declares the bearer scheme in the OpenAPI document; ``app.auth`` does the parsing, so that a
# malformed header is a 401 with a message rather than silently no key.
BEARER = HTTPBearer(
    auto_error=False,
    description=(
        "An API key from API_KEYS (`owner:key,...`), or an access token (JWT) from the identity "
        "provider when sign-in is on (AUTH_JWT_*); any value in single-user mode."
    ),
)
BearerDoc = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def get_owner(request: Request, services: ServicesDep, _documented: BearerDoc) -> str:
    return await services.auth.owner(request.headers.get("authorization"))


async def get_stream_owner(request: Request, services: ServicesDep, _documented: BearerDoc) -> str:
    """The stream route also accepts ``?access_token=``: an EventSource cannot set headers."""
    return await services.auth.owner(
        request.headers.get("authorization"), request.query_params.get("access_token")
    )


OwnerDep = Annotated[str, Depends(get_owner)]
StreamOwnerDep = Annotated[str, Depends(get_stream_owner)]
