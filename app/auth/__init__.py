"""Who is calling: API keys, and JWT access tokens from an identity provider (FACES.md J-01..J-03).

- ``authenticator.py``: ``Authenticator``, the owner a request's credentials name (or why not);
- ``tokens.py``: ``TokenVerifier``, the checks of an access token (J-02) and their refusals (J-03);
- ``keys.py``: ``SigningKeys``, the provider's JWK set, cached and fetched again rarely.

No FastAPI here: ``app.api.deps`` asks the ``Authenticator`` for every request.
"""

from __future__ import annotations

import logging

from app.auth.authenticator import SINGLE_USER_OWNER, Authenticator
from app.auth.keys import SigningKeys
from app.auth.tokens import TokenVerifier
from app.observability import Metrics
from app.settings import Settings

__all__ = ["SINGLE_USER_OWNER", "Authenticator", "build_authenticator"]

log = logging.getLogger("app.auth")


def build_authenticator(settings: Settings, metrics: Metrics) -> Authenticator:
    """The service's authenticator; its keys (if sign-in is on) start loading with ``start()``."""
    owner_keys = settings.owner_keys()
    tokens: TokenVerifier | None = None
    if settings.sign_in:
        keys = SigningKeys(
            jwks_url=settings.auth_jwt_jwks_url,
            oidc_issuer=settings.auth_oidc_issuer,
            refetch_s=settings.auth_jwt_refetch_s,
            metrics=metrics,
        )
        tokens = TokenVerifier(
            keys,
            issuer=settings.auth_jwt_issuer,
            audiences=settings.jwt_audiences(),
            owner_claim=settings.auth_jwt_owner_claim.strip(),
        )
        log.info(
            "sign-in: access tokens from the identity provider"
            + ("" if owner_keys else " only (API_KEYS is unset)"),
            extra={
                "keys": settings.auth_jwt_jwks_url or f"discovery of {settings.auth_oidc_issuer}",
                "issuer": settings.jwt_issuer,
                "audience": settings.auth_jwt_audience,
                "owner_claim": settings.auth_jwt_owner_claim,
            },
        )
    authenticator = Authenticator(owner_keys, tokens, metrics)
    if authenticator.single_user:
        log.warning("API_KEYS is unset: running in single-user mode (owner 'local'), no authentication")
    return authenticator
