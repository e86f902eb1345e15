"""JWT access tokens (FACES.md J-01, J-02): whose a token is, or why it is refused (J-03).

PyJWT checks the signature and the registered claims; this module pins what it is allowed to take:
the algorithm must be RS256, ES256 or EdDSA and the one of the key the ``kid`` names (so neither
``none`` nor an HMAC signature keyed with a public key can pass), ``exp`` is required, ``nbf`` and
``iat`` are honoured, each with ``LEEWAY_S`` of clock skew, and issuer and audience must match.
Refusals say why for the developer of the app, and never hold the token nor any part of it.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import jwt

from app.auth.keys import ALGORITHMS, KeysNotLoadedError, SigningKeys, UnknownKeyError
from app.errors import InvalidTokenError, SignInUnavailableError

LEEWAY_S = 60
MAX_OWNER_CHARS = 200
"""Owners are stored in columns of 200 characters."""


def looks_like_jwt(value: str) -> bool:
    """Three dot-separated parts: a JWS in compact form (an API key is taken for what it is first)."""
    return value.count(".") == 2


class TokenVerifier:
    """Checks access tokens against the provider's keys and the configured issuer and audience."""

    def __init__(
        self, keys: SigningKeys, *, issuer: str | None, audiences: list[str], owner_claim: str = "sub"
    ) -> None:
        self._keys = keys
        self._issuer = issuer
        self._audiences = audiences
        self._owner_claim = owner_claim

    @property
    def keys(self) -> SigningKeys:
        return self._keys

    async def owner(self, token: str) -> str:
        """The owner the token names (its ``AUTH_JWT_OWNER_CLAIM``); raises ``InvalidTokenError``,
        or ``SignInUnavailableError`` while the provider's keys could not be loaded yet."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise InvalidTokenError("malformed", "the access token is not a well-formed JWT") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            named = alg if isinstance(alg, str) and alg.isalnum() and len(alg) <= 10 else "unknown"
            raise InvalidTokenError(
                "algorithm",
                f"the access token's algorithm ({named}) is not accepted: RS256, ES256 or EdDSA only",
            )
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise InvalidTokenError("unknown_key", "the access token's header names no signing key (kid)")
        try:
            key = await self._keys.key(kid, alg)
        except UnknownKeyError:
            raise InvalidTokenError(
                "unknown_key",
                "the access token is signed with a key the identity provider does not publish (unknown kid)",
            ) from None
        except KeysNotLoadedError:
            raise SignInUnavailableError(
                "the identity provider's signing keys could not be loaded yet; retry shortly"
            ) from None
        if key.algorithm_name != alg:
            raise InvalidTokenError(
                "algorithm", f"the access token says {alg} but its key (kid) is an {key.algorithm_name} key"
            )
        claims = self._claims(token, key, alg)
        return self._owner_of(claims)

    def _claims(self, token: str, key: jwt.PyJWK, alg: str) -> dict[str, Any]:
        issuer = self._issuer or self._keys.issuer
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self._audiences,
                issuer=issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidTokenError("expired", "the access token has expired") from None
        except jwt.ImmatureSignatureError:
            raise InvalidTokenError(
                "not_yet_valid",
                f"the access token is not valid yet: its nbf or iat is more than {LEEWAY_S} s ahead "
                "(check the clocks)",
            ) from None
        except jwt.InvalidAudienceError:
            raise self._wrong_audience() from None
        except jwt.InvalidIssuerError:
            raise self._wrong_issuer(issuer) from None
        except jwt.MissingRequiredClaimError as exc:
            if exc.claim == "aud":
                raise self._wrong_audience() from None
            if exc.claim == "iss":
                raise self._wrong_issuer(issuer) from None
            raise InvalidTokenError("claims", f"the access token has no {exc.claim} claim") from None
        except jwt.InvalidSignatureError:
            raise InvalidTokenError("signature", "the access token's signature does not verify") from None
        except jwt.PyJWTError as exc:
            # A claim of the wrong type (exp not a number, say), or a token PyJWT cannot decode.
            raise InvalidTokenError(
                "claims", f"the access token's claims are not valid{_detail(exc, token)}"
            ) from None
        return claims

    def _wrong_audience(self) -> InvalidTokenError:
        return InvalidTokenError(
            "audience",
            f"the access token is not meant for this service: its aud does not name "
            f"{' or '.join(self._audiences)} (AUTH_JWT_AUDIENCE)",
        )

    @staticmethod
    def _wrong_issuer(issuer: str | None) -> InvalidTokenError:
        return InvalidTokenError(
            "issuer", f"the access token was not issued by {issuer} (AUTH_JWT_ISSUER / AUTH_OIDC_ISSUER)"
        )

    def _owner_of(self, claims: dict[str, Any]) -> str:
        value = claims.get(self._owner_claim)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise InvalidTokenError(
                "owner_claim",
                f"the access token has no {self._owner_claim} claim naming its user (AUTH_JWT_OWNER_CLAIM)",
            )
        # The owner is stored and compared as text: a number or a list is not taken for one (42
        # and "42" would be the same owner), nor text with control characters (a NUL is no
        # PostgreSQL text) or lone surrogates (no UTF-8).
        if not isinstance(value, str) or any(unicodedata.category(c) in ("Cc", "Cs") for c in value):
            raise InvalidTokenError(
                "owner_claim",
                f"the access token's {self._owner_claim} claim is unusable as its user: it must be "
                "text without control characters (AUTH_JWT_OWNER_CLAIM)",
            )
        if len(value) > MAX_OWNER_CHARS:
            raise InvalidTokenError(
                "owner_claim",
                f"the access token's {self._owner_claim} is longer than {MAX_OWNER_CHARS} characters",
            )
        return value


def _detail(exc: Exception, token: str) -> str:
    """PyJWT's word on what is wrong (": Subject must be a string"), if short and free of the token."""
    said = str(exc).strip()
    if not said or len(said) > 100 or any(part in said for part in token.split(".") if len(part) >= 4):
        return ""
    return f": {said}"
