"""One TLS context per process for the outgoing HTTPS clients (app/tls.py): the CA bundle is
loaded once, not once per client."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.auth.keys import SigningKeys
from app.llm.openai_client import default_http_client
from app.tls import client_tls


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How often a context is built from here on (the cache emptied first); a call given a
    context returns it as it is."""
    made: list[int] = []
    create = httpx.create_ssl_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        if not isinstance(kwargs.get("verify", args[0] if args else True), ssl.SSLContext):
            made.append(1)
        return create(*args, **kwargs)

    client_tls.cache_clear()
    monkeypatch.setattr(httpx, "create_ssl_context", counted)
    yield made
    client_tls.cache_clear()


def test_the_context_checks_certificates_and_host_names(builds: list[int]) -> None:
    context = client_tls()

    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert client_tls() is context


async def test_llm_clients_and_the_signing_key_fetcher_share_one_context(builds: list[int]) -> None:
    clients = [default_http_client(10, "https://llm.example/v1") for _ in range(3)]
    keys = SigningKeys(jwks_url="https://idp.example/jwks.json")

    assert len(builds) == 1
    assert keys._http._transport._pool._ssl_context is client_tls()  # type: ignore[attr-defined]
    for client in clients:
        await client.aclose()
    await keys._http.aclose()
