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
    assert settings(cors_allow_origins="https://app.test,*", api_keys="a:k").cors_origins() == ["*"]


@pytest.mark.parametrize("value", ["https://app.test/path", "app.test", "https://app.test:3000/#x", "null"])
def test_a_cors_origin_that_is_no_origin_stops_the_start(value: str) -> None:
    with pytest.raises(ValidationError, match="CORS_ALLOW_ORIGINS"):
        settings(cors_allow_origins=value)


@pytest.mark.parametrize("value", ["*", "https://app.test, *"])
def test_any_origin_on_a_single_user_service_stops_the_start(value: str) -> None:
    # No API keys, no sign-in: any web page the user opens could drive the service.
    with pytest.raises(ValidationError, match=r"CORS_ALLOW_ORIGINS=\* needs API_KEYS or sign-in"):
        settings(cors_allow_origins=value)
    with pytest.raises(ValidationError, match=r"CORS_ALLOW_ORIGINS=\* needs API_KEYS"):
        settings(cors_allow_origins=value, api_keys=" , ")  # no key in it: single-user all the same


@pytest.mark.parametrize(
    "values",
    [
        {"api_keys": "alice:key-of-alice"},
        {"auth_oidc_issuer": "https://idp.test/", "auth_jwt_audience": "api"},
    ],
)
def test_any_origin_goes_with_api_keys_or_sign_in(values: dict[str, Any]) -> None:
    assert settings(cors_allow_origins="*", **values).cors_origins() == ["*"]


def test_listed_origins_go_with_a_single_user_service() -> None:
    assert settings(cors_allow_origins="http://localhost:3000").cors_origins() == ["http://localhost:3000"]


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("AUTH_JWT_JWKS_URL", "http://idp.test/jwks"),
        ("AUTH_JWT_JWKS_URL", "http://127.0.0.1.idp.test/jwks"),
        ("AUTH_JWT_JWKS_URL", "http://localhost.idp.test/jwks"),
        ("AUTH_JWT_JWKS_URL", "http://10.0.0.5/jwks"),
        ("AUTH_OIDC_ISSUER", "http://idp.test/realms/r"),
    ],
)
def test_keys_over_plain_http_off_loopback_stop_the_start(name: str, url: str) -> None:
    values = {name.lower(): url, "auth_jwt_issuer": "https://idp.test/", "auth_jwt_audience": "api"}
    with pytest.raises(ValidationError, match=f"{name} must be an https URL"):
        settings(**values)


@pytest.mark.parametrize(
    "url",
    [
        "https://idp.test/jwks",
        "http://127.0.0.1:8080/jwks",
        "http://127.1.2.3/jwks",
        "http://localhost:8080/jwks",
        "http://LOCALHOST/jwks",
        "http://[::1]:8080/jwks",
    ],
)
def test_keys_over_https_or_loopback_http_are_taken(url: str) -> None:
    s = settings(auth_jwt_jwks_url=url, auth_jwt_issuer="https://idp.test/", auth_jwt_audience="api")
    assert s.auth_jwt_jwks_url == url
