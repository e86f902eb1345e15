"""Access tokens never appear in logs or responses (FACES.md J-03), as API keys do not (test_secrets.py).

The service runs as in production (``agentstream serve``, uvicorn's access log, ``LOG_LEVEL=DEBUG``,
JSON and text) with sign-in on against a local identity provider. Clients send good tokens in the
header and as the stream's ``?access_token=``, and refused ones of every kind (expired, wrong
audience, unknown key, ``alg: none``, malformed); then the service's whole output and every response
is searched for each token and for its claims and signature parts.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.security.test_secrets import Production
from tests.support.identity_provider import IdentityProvider, forge, new_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


def tokens_of(idp: IdentityProvider) -> dict[str, str]:
    user = f"user-{secrets.token_hex(4)}"
    return {
        "good": idp.token(user),
        "expired": idp.token(user, lifetime_s=-3600),
        "wrong audience": idp.token(user, aud="https://other.test"),
        "unknown key": idp.token(user, key=new_key("ES256", "unpublished")),
        "alg none": forge({"alg": "none", "kid": idp.key.kid}, idp.claims(user, nonce=secrets.token_hex(8))),
        "malformed": f"{secrets.token_urlsafe(24)}.{secrets.token_urlsafe(24)}.{secrets.token_urlsafe(24)}",
    }


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_no_access_token_reaches_a_log_or_a_response(
    log_format: str, idp: IdentityProvider, tmp_path: Path
) -> None:
    env = {
        **idp.env(),
        "LLM_BASE_URL": "",
        "DEMO_DELAY_S": "0",
        "DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'agentstream.db'}",
        "LOG_FORMAT": log_format,
        "LOG_LEVEL": "DEBUG",
        "SHUTDOWN_GRACE_S": "2",
    }
    tokens = tokens_of(idp)
    seen: list[str] = []
    service = Production(env, tmp_path)
    try:
        with httpx.Client(base_url=service.base_url, timeout=30) as http:

            def keep(response: httpx.Response) -> httpx.Response:
                seen.append(f"{response.status_code} {response.headers} {response.text}")
                return response

            good = {"Authorization": f"Bearer {tokens['good']}"}
            conversation = keep(http.post("/api/conversations", headers=good)).json()["id"]
            started = http.post(
                f"/api/conversations/{conversation}/runs", json={"message": "2+2?"}, headers=good
            )
            assert keep(started).status_code == 202
            stream = f"/api/conversations/{conversation}/stream"
            with http.stream("GET", stream, params={"access_token": tokens["good"]}) as response:
                response.read()
                assert "event: done" in keep(response).text
            keep(http.get("/v1/models", headers=good))
            for name, token in tokens.items():
                if name == "good":
                    continue
                assert (
                    keep(
                        http.get("/api/conversations", headers={"Authorization": f"Bearer {token}"})
                    ).status_code
                    == 401
                )
                assert keep(http.get(stream, params={"access_token": token})).status_code == 401
                assert (
                    keep(http.get("/v1/models", headers={"Authorization": f"Bearer {token}"})).status_code
                    == 401
                )
            keep(http.get("/metrics"))
            keep(http.get("/readyz"))
    finally:
        log = service.stop()

    assert "signing keys loaded" in log and "stream?access_token=[redacted]" in log, log[-2000:]
    everything = "\n".join([log, *seen])
    parts = {f"{name} token": token for name, token in tokens.items()}
    for name, token in tokens.items():
        _, claims, signature = token.split(".")
        parts[f"{name} claims"] = claims
        if len(signature) >= 16:
            parts[f"{name} signature"] = signature
    leaked = [name for name, part in parts.items() if part in everything]
    assert not leaked, {name: everything[everything.find(parts[name]) - 300 :][:400] for name in leaked}
