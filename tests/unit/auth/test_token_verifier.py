"""``TokenVerifier`` on a frozen clock (FACES.md J-02, J-03): the 60 s of leeway, to the second, for
``exp``, ``nbf`` and ``iat``; an ``aud`` list; the owner claim, which must be usable text; keys
that share a ``kid`` told apart by the token's algorithm. Its keys come through httpx's mock
transport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, tzinfo
from typing import Any

import httpx
import jwt
import pytest

from app.auth.keys import SigningKeys
from app.auth.tokens import LEEWAY_S, TokenVerifier
from app.errors import InvalidTokenError
from tests.support.identity_provider import SigningKey, new_key

JWKS_URL = "https://idp.test/jwks"
ISSUER = "https://idp.test/"
AUDIENCE = "https://agentstream.test/api"
NOW = 1_750_000_000
"""The clock PyJWT reads in these tests (a whole second: the claims are whole seconds)."""

RSA = new_key("RS256", "k1")
SHARED_RSA, SHARED_EC = new_key("RS256", "shared"), new_key("ES256", "shared")
"""Two keys of one kid (RFC 7517 4.5 allows it for keys of different types)."""


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz: tzinfo | None = None) -> _FrozenDatetime:
        return cls.fromtimestamp(NOW, tz=tz or UTC)


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jwt.api_jwt, "datetime", _FrozenDatetime)


@pytest.fixture(params=["sub"])
async def verifier(request: pytest.FixtureRequest) -> AsyncIterator[TokenVerifier]:
    """A verifier whose owner claim is ``sub``, or the ``indirect`` parameter's."""
    document = {"keys": [RSA.jwk(), SHARED_RSA.jwk(), SHARED_EC.jwk()]}
    keys = SigningKeys(
        jwks_url=JWKS_URL, transport=httpx.MockTransport(lambda _: httpx.Response(200, json=document))
    )
    try:
        yield TokenVerifier(keys, issuer=ISSUER, audiences=[AUDIENCE], owner_claim=request.param)
    finally:
        await keys.aclose()


def token(key: SigningKey = RSA, **claims: Any) -> str:
    """A token of ``key``, issued at NOW for five minutes; a claim passed as None is left out."""
    values: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-a", "iat": NOW, "exp": NOW + 300}
    values.update(claims)
    payload = {name: value for name, value in values.items() if value is not None}
    return jwt.encode(payload, key.private, algorithm=key.alg, headers={"kid": key.kid})


async def refused(verifier: TokenVerifier, presented: str) -> InvalidTokenError:
    with pytest.raises(InvalidTokenError) as caught:
        await verifier.owner(presented)
    return caught.value


def test_the_leeway_is_a_minute() -> None:
    assert LEEWAY_S == 60


@pytest.mark.parametrize(
    ("claims", "taken", "reason"),
    [
        ({"exp": NOW - 59}, True, "expired"),
        ({"exp": NOW - 61}, False, "expired"),
        ({"nbf": NOW + 59}, True, "not_yet_valid"),
        ({"nbf": NOW + 61}, False, "not_yet_valid"),
        ({"iat": NOW + 59}, True, "not_yet_valid"),
        ({"iat": NOW + 61}, False, "not_yet_valid"),
    ],
    ids=["exp-59s", "exp-61s", "nbf+59s", "nbf+61s", "iat+59s", "iat+61s"],
)
async def test_clocks_may_be_a_minute_apart_and_no_more(
    verifier: TokenVerifier, claims: dict[str, int], taken: bool, reason: str
) -> None:
    presented = token(**claims)
    if taken:
        assert await verifier.owner(presented) == "user-a"
    else:
        assert (await refused(verifier, presented)).reason == reason


async def test_an_aud_list_holding_the_audience_is_taken_and_one_without_it_refused(
    verifier: TokenVerifier,
) -> None:
    assert await verifier.owner(token(aud=["https://other.test/api", AUDIENCE])) == "user-a"
    error = await refused(verifier, token(aud=["https://other.test/api", "account"]))
    assert error.reason == "audience"


@pytest.mark.parametrize(
    "owner",
    [42, 0, True, ["user-a"], {"id": "user-a"}, "user\x00a", "user\na", "\x7f", "user\u0085a", "\ud800"],
    ids=["int", "zero", "bool", "list", "object", "nul", "newline", "del", "c1-control", "surrogate"],
)
@pytest.mark.parametrize("verifier", ["uid"], indirect=True)
async def test_an_owner_claim_that_is_no_plain_text_is_refused_as_unusable(
    verifier: TokenVerifier, owner: Any
) -> None:
    # A claim of the provider's (PyJWT itself refuses a sub that is no string): 42 is no "42".
    error = await refused(verifier, token(uid=owner))
    assert error.reason == "owner_claim"
    assert "uid claim is unusable" in error.message


@pytest.mark.parametrize("sub", ["user\x00a", "\x1b[31m"], ids=["nul", "escape"])
async def test_a_sub_with_control_characters_is_refused_as_unusable(
    verifier: TokenVerifier, sub: str
) -> None:
    error = await refused(verifier, token(sub=sub))
    assert error.reason == "owner_claim"
    assert "sub claim is unusable" in error.message


@pytest.mark.parametrize("sub", [None, "", "   "], ids=["missing", "empty", "blank"])
async def test_a_missing_or_empty_owner_claim_is_refused(verifier: TokenVerifier, sub: str | None) -> None:
    error = await refused(verifier, token(sub=sub))
    assert error.reason == "owner_claim"
    assert "has no sub claim" in error.message


async def test_an_owner_claim_of_any_language_is_taken(verifier: TokenVerifier) -> None:
    assert await verifier.owner(token(sub="usuário-ñ 名前 😀")) == "usuário-ñ 名前 😀"


async def test_keys_sharing_a_kid_are_picked_by_the_token_s_algorithm(verifier: TokenVerifier) -> None:
    assert await verifier.owner(token(SHARED_RSA, sub="by-rsa")) == "by-rsa"
    assert await verifier.owner(token(SHARED_EC, sub="by-ec")) == "by-ec"
