"""Sign-in with JWT access tokens (FACES.md J-01..J-03), through the real service and a local identity
provider (tests/support/identity_provider.py) that serves its keys over HTTP and signs the tokens.

Tokens of two users are kept apart, on every route, face and the stream's ``?access_token=``, beside
API keys; every check of J-02 refuses its token with a 401 that says why and never holds the token,
counted by reason; the keys are fetched again for an unknown ``kid`` once, then not for 30 s; a
rotated key is taken without a restart; cached keys work while the provider is down; the service
starts while it is down; a provider that never answers holds a request a moment only; ``/readyz``
says whether the keys could be loaded.
"""

from __future__ import annotations

import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.auth import keys as keys_module
from app.settings import Settings
from tests.integration.service.conftest import LogRecorder, Service, ServiceFactory
from tests.support.identity_provider import IdentityProvider, SigningKey, forge, hs256_with, new_key
from tests.support.server import ServerThread, wait_until
from tests.support.sse import read_events

API_KEY = "key-of-alice"
CHALLENGE = 'Bearer error="invalid_token"'


def settings_for(database_url: str, idp: IdentityProvider, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "api_keys": f"alice:{API_KEY}",
        "llm_base_url": None,
        "demo_delay_s": 0,
        "shutdown_grace_s": 0,
        "log_level": "WARNING",
        **idp.settings(),
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(scope="module")
def idp() -> Iterator[IdentityProvider]:
    provider = IdentityProvider()
    provider.publish(provider.key, new_key("ES256"), new_key("EdDSA"))
    with provider:
        yield provider


@pytest.fixture(scope="module")
def signed_in(
    idp: IdentityProvider, sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """One service per module: API keys and the provider's tokens, SQLite, the demo model."""
    path = tmp_path_factory.mktemp("sign-in") / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, path)
    settings = settings_for(f"sqlite+aiosqlite:///{path}", idp)
    svc = Service(ServerThread(settings).start(), settings, None)
    wait_keys(svc.base_url, "ok")
    try:
        yield svc
    finally:
        svc.stop()


def wait_keys(base_url: str, state: str, timeout: float = 15.0) -> dict[str, Any]:
    """Waits until ``/readyz`` says the signing keys are in ``state``; its body."""

    def ready() -> dict[str, Any] | None:
        body: dict[str, Any] = httpx.get(f"{base_url}/readyz", timeout=5).json()
        return body if body["checks"].get("signing_keys") == state else None

    return wait_until(ready, timeout=timeout, what=f"signing keys {state}")  # type: ignore[no-any-return]


def user() -> str:
    """A user nobody used before (the module's service is shared)."""
    return f"user-{secrets.token_hex(4)}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def client(svc: Service, token: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=svc.base_url, headers=bearer(token) if token else {}, timeout=15)


def failures(base_url: str) -> dict[str, float]:
    """``agentstream_auth_failures_total`` by reason."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    pattern = r'^agentstream_auth_failures_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def key_fetches(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    pattern = r'^agentstream_auth_key_fetches_total\{outcome="([a-z]+)"\} ([0-9.e+]+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def assert_refused(response: httpx.Response, token: str, says: str) -> None:
    """401, the invalid_token challenge, a message with ``says``, and nothing of the token."""
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "unauthorized"
    assert says in error["message"], error["message"]
    challenge = response.headers["www-authenticate"]
    assert challenge.startswith(CHALLENGE), challenge
    assert says in challenge, challenge
    seen = response.text + " ".join(f"{k}: {v}" for k, v in response.headers.items())
    for part in (token, *[p for p in token.split(".") if len(p) >= 8]):
        assert part not in seen, "the refusal echoes the token"


# ---- two users, every face ---------------------------------------------------------------------


def test_tokens_of_two_users_each_see_only_their_own_conversations(
    signed_in: Service, idp: IdentityProvider
) -> None:
    ann, ben = user(), user()
    rs256, es256 = idp.token(ann), idp.token(ben, key=idp.published["ES256"])
    with client(signed_in, rs256) as a, client(signed_in, es256) as b:
        conv = a.post("/api/conversations", json={"title": "mine"}).json()
        started = a.post(f"/api/conversations/{conv['id']}/runs", json={"message": "What is 2+2?"})
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]

        assert [c["id"] for c in a.get("/api/conversations").json()["items"]] == [conv["id"]]
        assert b.get("/api/conversations").json()["items"] == []
        for method, path in (
            ("GET", f"/api/conversations/{conv['id']}"),
            ("GET", f"/api/conversations/{conv['id']}/stream"),
            ("POST", f"/api/conversations/{conv['id']}/cancel"),
            ("GET", f"/api/runs/{run_id}"),
            ("GET", f"/api/runs/{run_id}/events"),
            ("DELETE", f"/api/conversations/{conv['id']}"),
        ):
            assert b.request(method, path).status_code == 404, (method, path)
        assert a.get(f"/api/conversations/{conv['id']}").status_code == 200


@pytest.mark.parametrize("alg", ["RS256", "ES256", "EdDSA"])
def test_a_token_signed_with_each_pinned_algorithm_is_taken(
    signed_in: Service, idp: IdentityProvider, alg: str
) -> None:
    with client(signed_in, idp.token(user(), key=idp.published[alg])) as http:
        assert http.get("/api/conversations").status_code == 200


def test_tokens_work_on_the_protocol_faces_and_the_openai_face(
    signed_in: Service, idp: IdentityProvider
) -> None:
    token, expired = idp.token(user()), idp.token(user(), lifetime_s=-3600)
    with client(signed_in, token) as http:
        assert http.get("/api/ai-sdk/chat/x/messages").json() == []
        assert http.get("/v1/models").status_code == 200
        body = {
            "threadId": "thread-1",
            "runId": "run-1",
            "messages": [{"id": "m1", "role": "user", "content": "What is 2+2?"}],
            "tools": [],
            "context": [],
            "state": {},
            "forwardedProps": {},
        }
        with http.stream("POST", "/api/ag-ui", json=body) as response:
            assert response.status_code == 200
            assert "RUN_FINISHED" in response.read().decode()
    with client(signed_in, expired) as http:
        assert_refused(http.get("/api/ai-sdk/chat/x/messages"), expired, "expired")
        assert_refused(http.post("/api/ag-ui", json=body), expired, "expired")
        # /v1 answers in OpenAI's shape, with the same challenge.
        refused = http.get("/v1/models")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "expired" in refused.json()["error"]["message"]
        assert refused.headers["www-authenticate"].startswith(CHALLENGE)


def test_the_stream_takes_the_token_as_access_token_however_long(
    signed_in: Service, idp: IdentityProvider
) -> None:
    # Providers put roles, groups and more in their tokens: 8 KiB must pass, header and query alike.
    token = idp.token(user(), roles=["r" * 40] * 140)
    assert len(token) > 8 * 1024
    with client(signed_in, token) as http:
        conv = http.post("/api/conversations").json()
        assert http.post(f"/api/conversations/{conv['id']}/runs", json={"message": "hi"}).status_code == 202
    with httpx.Client(base_url=signed_in.base_url, timeout=15) as browser:
        path = f"/api/conversations/{conv['id']}/stream"
        with browser.stream("GET", path, params={"access_token": token}) as response:
            assert response.status_code == 200
            events = read_events(response)
        assert events[-1].event == "done"
        assert events[-1].data["status"] == "completed"
        # Only the stream takes it from the query.
        elsewhere = browser.get(f"/api/conversations/{conv['id']}", params={"access_token": token})
        assert elsewhere.status_code == 401
        assert elsewhere.headers["www-authenticate"] == "Bearer"
        expired = idp.token(user(), lifetime_s=-3600)
        assert_refused(browser.get(path, params={"access_token": expired}), expired, "expired")


def test_api_keys_keep_working_beside_tokens(signed_in: Service, idp: IdentityProvider) -> None:
    with client(signed_in, API_KEY) as alice, client(signed_in, idp.token(user())) as ann:
        conv = alice.post("/api/conversations", json={"title": "by key"}).json()
        assert alice.get(f"/api/conversations/{conv['id']}").status_code == 200
        assert ann.get(f"/api/conversations/{conv['id']}").status_code == 404
        assert conv["id"] not in [c["id"] for c in ann.get("/api/conversations").json()["items"]]
    with client(signed_in, "not-a-key") as stranger:
        refused = stranger.get("/api/conversations")
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "invalid API key"
    assert refused.headers["www-authenticate"].startswith(CHALLENGE)


# ---- refusals ----------------------------------------------------------------------------------


def _other_key_same_kid(idp: IdentityProvider) -> str:
    impostor = SigningKey(idp.key.kid, "RS256", new_key("RS256").private)
    return idp.token(user(), key=impostor)


def _tampered(idp: IdentityProvider) -> str:
    header, _, signature = idp.token(user()).split(".")
    claims = forge({}, idp.claims(user(), lifetime_s=10**6)).split(".")[1]
    return f"{header}.{claims}.{signature}"


REFUSED: dict[str, tuple[Callable[[IdentityProvider], str], str, str]] = {
    "expired": (lambda idp: idp.token(user(), lifetime_s=-120), "expired", "has expired"),
    "not yet valid": (
        lambda idp: idp.token(user(), nbf=int(time.time()) + 600),
        "not_yet_valid",
        "not valid yet",
    ),
    "issued in the future": (
        lambda idp: idp.token(user(), iat=int(time.time()) + 600),
        "not_yet_valid",
        "not valid yet",
    ),
    "wrong issuer": (lambda idp: idp.token(user(), iss="https://other.test/"), "issuer", "not issued by"),
    "no issuer": (lambda idp: idp.token(user(), iss=None), "issuer", "not issued by"),
    "wrong audience": (
        lambda idp: idp.token(user(), aud="https://other.test/api"),
        "audience",
        "not meant for this service",
    ),
    "no audience": (lambda idp: idp.token(user(), aud=None), "audience", "not meant for this service"),
    "no expiry": (lambda idp: idp.token(user(), exp=None), "claims", "has no exp claim"),
    "no owner claim": (lambda idp: idp.token(None), "owner_claim", "has no sub claim"),
    "empty owner claim": (lambda idp: idp.token(""), "owner_claim", "has no sub claim"),
    "owner claim with a NUL": (lambda idp: idp.token("user\x00a"), "owner_claim", "sub claim is unusable"),
    "owner claim with a newline": (lambda idp: idp.token("user\na"), "owner_claim", "sub claim is unusable"),
    "alg none": (
        lambda idp: forge({"alg": "none", "kid": idp.key.kid, "typ": "JWT"}, idp.claims(user())),
        "algorithm",
        "(none) is not accepted",
    ),
    "HS256 keyed with the public key": (
        lambda idp: forge(
            {"alg": "HS256", "kid": idp.key.kid, "typ": "JWT"},
            idp.claims(user()),
            hs256_with(idp.key.public_pem()),
        ),
        "algorithm",
        "(HS256) is not accepted",
    ),
    "alg of another key type": (
        lambda idp: forge({"alg": "ES256", "kid": idp.key.kid}, idp.claims(user()), lambda _: b"x" * 64),
        "algorithm",
        "is an RS256 key",
    ),
    "signed by another key": (_other_key_same_kid, "signature", "signature does not verify"),
    "claims changed after signing": (_tampered, "signature", "signature does not verify"),
    "no kid": (
        lambda idp: forge({"alg": "RS256"}, idp.claims(user()), lambda _: b"x" * 256),
        "unknown_key",
        "names no signing key",
    ),
    "unknown kid": (
        lambda idp: idp.token(user(), key=new_key("RS256", "not-published")),
        "unknown_key",
        "unknown kid",
    ),
    "not a JWT": (lambda idp: "eyJhbGciOi.not-base64!.x", "malformed", "not a well-formed JWT"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_token_that_fails_a_check_is_refused_saying_why_and_counted(
    signed_in: Service, idp: IdentityProvider, case: str
) -> None:
    make, reason, says = REFUSED[case]
    token = make(idp)
    before = failures(signed_in.base_url).get(reason, 0)
    with client(signed_in, token) as http:
        conversations = http.get("/api/conversations")
        created = http.post("/api/conversations", json={"title": "never"})
    assert_refused(conversations, token, says)
    assert_refused(created, token, says)
    assert failures(signed_in.base_url).get(reason, 0) == before + 2


def test_clocks_apart_by_less_than_a_minute_are_forgiven(signed_in: Service, idp: IdentityProvider) -> None:
    now = int(time.time())
    for token in (
        idp.token(user(), lifetime_s=-30),  # expired 30 s ago
        idp.token(user(), nbf=now + 30, iat=now + 30),  # valid 30 s from now
    ):
        with client(signed_in, token) as http:
            assert http.get("/api/conversations").status_code == 200


def test_with_sign_in_and_no_api_keys_every_request_needs_a_token(
    service: ServiceFactory, idp: IdentityProvider, app_logs: LogRecorder
) -> None:
    svc = service(**idp.settings())
    wait_keys(svc.base_url, "ok")
    with client(svc) as anonymous:
        missing = anonymous.get("/api/conversations")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "access token" in missing.json()["error"]["message"]
    assert failures(svc.base_url) == {"missing": 1}
    with client(svc, idp.token(user())) as http:
        assert http.get("/api/conversations").status_code == 200
    assert not any("single-user mode" in line for line in app_logs.lines)


# ---- the provider's keys -----------------------------------------------------------------------


@pytest.fixture
def own_idp() -> Iterator[IdentityProvider]:
    """A provider of the test's own, whose fetches the test counts."""
    with IdentityProvider() as provider:
        yield provider


def test_an_unknown_kid_fetches_the_keys_once_and_then_not_again_within_30_s(
    service: ServiceFactory, own_idp: IdentityProvider
) -> None:
    svc = service(api_keys=f"alice:{API_KEY}", **own_idp.settings())
    wait_keys(svc.base_url, "ok")
    assert own_idp.jwks_fetches == 1

    forged = own_idp.token(user(), key=new_key("RS256", "forged-0"))
    with client(svc, forged) as http:
        assert_refused(http.get("/api/conversations"), forged, "unknown kid")
    assert own_idp.jwks_fetches == 2

    # A storm of forged kids, one after the other and all at once: no fetch more.
    forgeries = [
        own_idp.token(user(), key=SigningKey(f"forged-{i}", "RS256", own_idp.key.private))
        for i in range(1, 41)
    ]

    def attempt(token: str) -> int:
        with client(svc, token) as http:
            return http.get("/api/conversations").status_code

    assert [attempt(t) for t in forgeries[:10]] == [401] * 10
    with ThreadPoolExecutor(max_workers=10) as pool:
        assert list(pool.map(attempt, forgeries[10:])) == [401] * 30
    assert own_idp.jwks_fetches == 2
    assert key_fetches(svc.base_url) == {"ok": 2}
    assert failures(svc.base_url)["unknown_key"] == 41
    with client(svc, own_idp.token(user())) as http:
        assert http.get("/api/conversations").status_code == 200


def test_a_rotated_key_is_taken_without_a_restart_and_a_withdrawn_one_refused(
    service: ServiceFactory, own_idp: IdentityProvider
) -> None:
    old = own_idp.key
    svc = service(**own_idp.settings())
    wait_keys(svc.base_url, "ok")
    ann = user()
    with client(svc, own_idp.token(ann, key=old)) as http:
        conv = http.post("/api/conversations").json()

    new = new_key("ES256")
    own_idp.publish(new)
    with client(svc, own_idp.token(ann, key=new)) as http:
        assert http.get(f"/api/conversations/{conv['id']}").status_code == 200  # the same user
    assert own_idp.jwks_fetches == 2
    withdrawn = own_idp.token(ann, key=old)
    with client(svc, withdrawn) as http:
        assert_refused(http.get("/api/conversations"), withdrawn, "unknown kid")


def test_while_the_provider_is_down_the_cached_keys_keep_working(
    service: ServiceFactory, own_idp: IdentityProvider
) -> None:
    svc = service(**own_idp.settings())
    wait_keys(svc.base_url, "ok")
    token = own_idp.token(user())
    own_idp.stop()

    with client(svc, token) as http:
        assert http.get("/api/conversations").status_code == 200
    forged = own_idp.token(user(), key=new_key("RS256", "while-down"))
    with client(svc, forged) as http:
        assert_refused(http.get("/api/conversations"), forged, "unknown kid")  # its refetch failed
    ready = httpx.get(f"{svc.base_url}/readyz", timeout=5)
    assert ready.status_code == 200  # API keys and cached keys still serve
    assert ready.json()["checks"]["signing_keys"] == "stale"
    assert key_fetches(svc.base_url) == {"ok": 1, "failed": 1}
    with client(svc, token) as http:
        assert http.get("/api/conversations").status_code == 200


def test_the_service_starts_while_the_provider_is_down_and_takes_tokens_once_it_is_up(
    service: ServiceFactory,
) -> None:
    idp = IdentityProvider()  # not started: its port refuses connections
    svc = service(api_keys=f"alice:{API_KEY}", **idp.settings())
    try:
        ready = httpx.get(f"{svc.base_url}/readyz", timeout=5)
        assert ready.status_code == 200
        assert ready.json()["checks"]["signing_keys"] == "not_loaded"
        with client(svc, API_KEY) as alice:
            assert alice.post("/api/conversations").status_code == 201
        token = idp.token(user())
        with client(svc, token) as http:
            early = http.get("/api/conversations")
        assert early.status_code == 503
        assert early.json()["error"]["code"] == "sign_in_unavailable"
        assert early.headers["retry-after"]
        assert token not in early.text
        assert failures(svc.base_url) == {"keys_unavailable": 1}
        with client(svc, token) as http:
            openai = http.get("/v1/models")  # in OpenAI's shape, with the same Retry-After
        assert openai.status_code == 503
        assert openai.json()["error"]["code"] == "sign_in_unavailable"
        assert openai.headers["retry-after"] == early.headers["retry-after"]

        idp.start()
        wait_keys(svc.base_url, "ok", timeout=30)  # the background task tries again, backing off
        with client(svc, token) as http:
            assert http.get("/api/conversations").status_code == 200
    finally:
        idp.stop()


def test_the_keys_are_found_through_the_issuer_s_discovery_document(
    service: ServiceFactory, own_idp: IdentityProvider
) -> None:
    svc = service(**own_idp.settings(discovery=True))
    wait_keys(svc.base_url, "ok")
    assert own_idp.discoveries == 1
    with client(svc, own_idp.token(user())) as http:
        assert http.get("/api/conversations").status_code == 200
    wrong = own_idp.token(user(), iss="https://other.test/")
    with client(svc, wrong) as http:
        assert_refused(http.get("/api/conversations"), wrong, own_idp.issuer)


def test_a_provider_that_takes_requests_and_never_answers_holds_a_request_a_moment_only(
    service: ServiceFactory, own_idp: IdentityProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keys_module, "REQUEST_WAIT_S", 0.2, raising=False)
    within = keys_module.FETCH_TIMEOUT_S / 2  # a request that waited for the fetch times out
    own_idp.hang()
    svc = service(api_keys=f"alice:{API_KEY}", **own_idp.settings())
    wait_until(lambda: own_idp.held == 1, what="the first fetch of the keys, held")
    token = own_idp.token(user())
    with httpx.Client(base_url=svc.base_url, headers=bearer(token), timeout=within) as http:
        early = http.get("/api/conversations")
        openai = http.get("/v1/models")
    assert early.status_code == 503
    assert early.json()["error"]["code"] == "sign_in_unavailable"
    assert openai.status_code == 503
    assert openai.headers["retry-after"]
    with client(svc, API_KEY) as alice:
        assert alice.get("/api/conversations").status_code == 200
    assert own_idp.held == 1  # the requests joined the fetch under way, which goes on
    assert httpx.get(f"{svc.base_url}/readyz", timeout=5).json()["checks"]["signing_keys"] == "not_loaded"


def test_an_unknown_kid_waits_a_moment_only_for_a_refetch_that_is_never_answered(
    service: ServiceFactory, own_idp: IdentityProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keys_module, "REQUEST_WAIT_S", 0.2, raising=False)
    within = keys_module.FETCH_TIMEOUT_S / 2
    svc = service(**own_idp.settings())
    wait_keys(svc.base_url, "ok")
    own_idp.hang()
    rotated = own_idp.token(user(), key=new_key("RS256", "rotated"))
    with httpx.Client(base_url=svc.base_url, headers=bearer(rotated), timeout=within) as http:
        assert_refused(http.get("/api/conversations"), rotated, "unknown kid")
    with httpx.Client(base_url=svc.base_url, headers=bearer(own_idp.token(user())), timeout=within) as http:
        assert http.get("/api/conversations").status_code == 200  # the cached keys serve meanwhile
