"""``Authenticator``: the owner a request's credentials name, an API key or an access token.

``API_KEYS`` are compared first (in constant time, against every key); a credential that is none of
them and has the form of a JWT is checked as an access token when sign-in is on (FACES.md J-01).
Without either, the service is single-user. Every refusal is counted in
``agentstream_auth_failures_total{reason}`` (J-03).
"""

from __future__ import annotations

import hmac

from app.auth.tokens import TokenVerifier, looks_like_jwt
from app.errors import InvalidTokenError, ServiceError, SignInUnavailableError, UnauthorizedError
from app.observability import Metrics

SINGLE_USER_OWNER = "local"


class Authenticator:
    def __init__(self, owner_keys: dict[str, str], tokens: TokenVerifier | None, metrics: Metrics) -> None:
        self._owner_keys = owner_keys
        self.tokens = tokens
        self._metrics = metrics

    def start(self) -> None:
        """Starts loading the provider's keys in the background (the service starts regardless)."""
        if self.tokens is not None:
            self.tokens.keys.start()

    async def aclose(self) -> None:
        if self.tokens is not None:
            await self.tokens.keys.aclose()

    @property
    def single_user(self) -> bool:
        """Neither API keys nor sign-in: every caller is the one local user."""
        return not self._owner_keys and self.tokens is None

    async def owner(self, authorization: str | None, access_token: str | None = None) -> str:
        """The owner of an ``Authorization`` header's bearer credential, else of ``access_token``
        (the stream's query parameter, for an EventSource that cannot send headers)."""
        if self.single_user:
            # Single-user mode authenticates nothing, so it also refuses nothing: a proxy in front
            # may well send its own Authorization header.
            return SINGLE_USER_OWNER
        try:
            presented = _bearer(authorization) or access_token
            if not presented:
                raise UnauthorizedError(
                    "missing credentials: send Authorization: Bearer <API key or access token>"
                )
            return await self._owner_of(presented)
        except ServiceError as exc:
            self._metrics.auth_failures.labels(_reason(exc)).inc()
            raise

    async def _owner_of(self, presented: str) -> str:
        owner: str | None = None
        # Compare against every key so the time taken does not reveal which prefix matched.
        for key, who in self._owner_keys.items():
            if hmac.compare_digest(key.encode(), presented.encode()):
                owner = who
        if owner is not None:
            return owner
        if looks_like_jwt(presented):
            if self.tokens is not None:
                return await self.tokens.owner(presented)
            raise InvalidTokenError(
                "invalid_api_key",
                "invalid API key; access tokens (JWTs) are not accepted here: sign-in is off "
                "(AUTH_JWT_JWKS_URL and AUTH_OIDC_ISSUER are unset)",
            )
        raise InvalidTokenError("invalid_api_key", "invalid API key")


class _BadHeaderError(UnauthorizedError):
    reason = "bad_header"


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise _BadHeaderError("the Authorization header must be 'Bearer <API key or access token>'")
    return value.strip()


def _reason(exc: ServiceError) -> str:
    if isinstance(exc, InvalidTokenError | _BadHeaderError):
        return exc.reason
    if isinstance(exc, SignInUnavailableError):
        return "keys_unavailable"
    return "missing"
