"""The sign-in and CORS settings (FACES.md J-01, J-04): what a start takes, and what stops it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.settings import Settings


def settings(**values: Any) -> Settings:
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def test_discovery_gives_the_issuer_and_the_audience_may_be_several() -> None:
    s = settings(auth_oidc_issuer="https://idp.test/realms/r", auth_jwt_audience="api, other-api")
    assert s.sign_in
    assert s.jwt_issuer == "https://idp.test/realms/r"
    assert s.jwt_audiences() == ["api", "other-api"]
    assert s.auth_jwt_owner_claim == "sub"
    assert s.auth_jwt_refetch_s == 30


def test_without_a_provider_sign_in_is_off_and_empty_values_are_unset() -> None:
    s = settings(auth_jwt_jwks_url="", auth_oidc_issuer=" ", cors_allow_origins="")
    assert not s.sign_in
    assert s.cors_origins() == []


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"auth_jwt_jwks_url": "https://idp.test/jwks", "auth_jwt_audience": "api"}, "their issuer"),
        ({"auth_oidc_issuer": "https://idp.test/"}, "their audience"),
        ({"auth_jwt_issuer": "https://idp.test/", "auth_jwt_audience": "api"}, "need AUTH_JWT_JWKS_URL"),
        ({"auth_oidc_issuer": "idp.test", "auth_jwt_audience": "api"}, "http(s) URL"),
        (
            {
                "auth_oidc_issuer": "https://idp.test/",
                "auth_jwt_audience": "api",
                "auth_jwt_owner_claim": " ",
            },
            "must name a claim",
        ),
    ],
)
def test_an_incomplete_sign_in_stops_the_start(values: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says.replace("(", r"\(").replace(")", r"\)")):
        settings(**values)


def test_cors_origins_are_origins_and_a_star_stands_alone() -> None:
    s = settings(cors_allow_origins=" https://app.test/ ,http://localhost:3000")
    assert s.cors_origins() == ["https://app.test", "http://localhost:3000"]
    assert settings(cors_allow_origins="https://app.test,*").cors_origins() == ["*"]


@pytest.mark.parametrize("value", ["https://app.test/path", "app.test", "https://app.test:3000/#x", "null"])
def test_a_cors_origin_that_is_no_origin_stops_the_start(value: str) -> None:
    with pytest.raises(ValidationError, match="CORS_ALLOW_ORIGINS"):
        settings(cors_allow_origins=value)
