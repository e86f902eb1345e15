"""CORS (FACES.md J-04) through the real service: preflights of every route and face, from allowed and
refused origins, with the headers a browser app sends; credentials; the headers of answers, refusals,
unexpected 500s and streams. A page of another origin reading a stream in Chromium is in
tests/browser/test_sign_in.py.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.responses import StreamingResponse

from app.settings import Settings
from tests.integration.service.conftest import Service, ServiceFactory
from tests.support.identity_provider import IdentityProvider
from tests.support.server import ServerThread
from tests.support.sse import read_events

APP = "http://app.test:3000"
OTHER_APP = "https://chat.example.com"
STRANGER = "https://evil.test"
API_KEY = "key-of-alice"

# What the browser app calls: every route family and face, with the method it uses.
PREFLIGHTED = [
    ("POST", "/api/conversations"),
    ("GET", "/api/conversations/c1/stream"),
    ("POST", "/api/conversations/c1/runs"),
    ("DELETE", "/api/conversations/c1"),
    ("PUT", "/api/conversations/c1/head"),
    ("POST", "/api/conversations/c1/approvals/a1"),
    ("POST", "/api/chat"),
    ("POST", "/api/ai-sdk/chat"),
    ("GET", "/api/ai-sdk/chat/c1/stream"),
    ("POST", "/api/ag-ui"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
]


@pytest.fixture(scope="module")
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


@pytest.fixture(scope="module")
def cors_service(
    idp: IdentityProvider, sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    path = tmp_path_factory.mktemp("cors") / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, path)
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=f"sqlite+aiosqlite:///{path}",
        api_keys=f"alice:{API_KEY}",
        llm_base_url=None,
        demo_delay_s=0,
        shutdown_grace_s=0,
        log_level="WARNING",
        # a trailing "/" (as copied from an address bar) is no part of an origin
        cors_allow_origins=f"{APP}, {OTHER_APP}/",
        **idp.settings(),
    )
    svc = Service(ServerThread(settings).start(), settings, None)
    try:
        yield svc
    finally:
        svc.stop()


def preflight(base_url: str, method: str, path: str, origin: str, headers: str) -> httpx.Response:
    return httpx.options(
        f"{base_url}{path}",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers,
        },
        timeout=5,
    )


@pytest.mark.parametrize(("method", "path"), PREFLIGHTED)
@pytest.mark.parametrize("origin", [APP, OTHER_APP])
def test_a_preflight_from_an_allowed_origin_allows_the_call_with_credentials(
    cors_service: Service, method: str, path: str, origin: str
) -> None:
    asked = "authorization, content-type, last-event-id"
    response = preflight(cors_service.base_url, method, path, origin, asked)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == origin
    assert response.headers["access-control-allow-credentials"] == "true"
    assert method in response.headers["access-control-allow-methods"].split(", ")
    allowed = {h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "last-event-id"} <= allowed
    assert "origin" in response.headers["vary"].lower()


def test_a_preflight_from_another_origin_is_refused(cors_service: Service) -> None:
    for origin in (STRANGER, "http://app.test:3001", "https://app.test:3000", "null"):
        response = preflight(cors_service.base_url, "POST", "/api/conversations", origin, "authorization")
        assert response.status_code == 400, origin
        assert "access-control-allow-origin" not in response.headers, origin


def test_answers_refusals_and_streams_carry_the_origin_and_expose_why(
    cors_service: Service, idp: IdentityProvider
) -> None:
    token = idp.token("user-cors")
    with httpx.Client(base_url=cors_service.base_url, headers={"Origin": APP}, timeout=15) as page:
        created = page.post("/api/conversations", headers={"Authorization": f"Bearer {token}"})
        assert created.status_code == 201
        assert created.headers["access-control-allow-origin"] == APP
        assert created.headers["access-control-allow-credentials"] == "true"
        conv = created.json()["id"]
        started = page.post(
            f"/api/conversations/{conv}/runs",
            json={"message": "What is 2+2?"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert started.status_code == 202

        # A refusal is readable by the page: the origin, and the challenge saying why.
        expired = idp.token("user-cors", lifetime_s=-3600)
        refused = page.get("/api/conversations", headers={"Authorization": f"Bearer {expired}"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == APP
        exposed = {h.strip().lower() for h in refused.headers["access-control-expose-headers"].split(",")}
        assert {"www-authenticate", "retry-after"} <= exposed

        stream = f"/api/conversations/{conv}/stream"
        with page.stream("GET", stream, params={"access_token": token}) as response:
            assert response.status_code == 200
            assert response.headers["access-control-allow-origin"] == APP
            events = read_events(response)
        assert events[-1].event == "done"

    with httpx.Client(base_url=cors_service.base_url, headers={"Origin": STRANGER}, timeout=15) as stranger:
        # Answered (CORS is the browser's to enforce), but with nothing that lets a page read it.
        answer = stranger.get("/api/conversations", headers={"Authorization": f"Bearer {token}"})
        assert "access-control-allow-origin" not in answer.headers


def test_cors_is_off_unless_configured_and_a_star_never_goes_with_credentials(
    service: ServiceFactory,
) -> None:
    def preflight_and_answer(svc: Service) -> tuple[httpx.Response, httpx.Response]:
        asked = "authorization, content-type"
        allowed = preflight(svc.base_url, "POST", "/api/conversations", STRANGER, asked)
        answer = httpx.get(
            f"{svc.base_url}/api/conversations",
            headers={"Origin": STRANGER, "Authorization": f"Bearer {API_KEY}"},
            timeout=5,
        )
        return allowed, answer

    allowed, answer = preflight_and_answer(service(cors_allow_origins="*", api_keys=f"alice:{API_KEY}"))
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "*"
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "*"
    for response in (allowed, answer):
        assert "access-control-allow-credentials" not in response.headers

    allowed, answer = preflight_and_answer(service(api_keys=f"alice:{API_KEY}"))
    assert answer.status_code == 200
    for response in (allowed, answer):
        assert "access-control-allow-origin" not in response.headers


def test_an_unexpected_500_carries_the_origin_so_the_page_can_read_it(
    sqlite_migrated_template: Path, tmp_path: Path
) -> None:
    path = tmp_path / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, path)
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=f"sqlite+aiosqlite:///{path}",
        api_keys=f"alice:{API_KEY}",
        llm_base_url=None,
        shutdown_grace_s=0,
        log_level="CRITICAL",
        cors_allow_origins=APP,
    )
    server = ServerThread(settings)

    async def broken() -> None:
        raise RuntimeError("a bug")

    async def broken_stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: first\n\n"
            raise RuntimeError("a bug, after the answer started")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    # Only in this test's app: routes that fail as a bug would.
    server.app.add_api_route("/test-only/broken", broken)
    server.app.add_api_route("/test-only/broken-stream", broken_stream)
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, headers={"Origin": APP}, timeout=5) as page:
            failed = page.get("/test-only/broken")
            assert failed.status_code == 500
            assert failed.json() == {"error": {"code": "internal_error", "message": "internal error"}}
            assert failed.headers["access-control-allow-origin"] == APP
            assert failed.headers["access-control-allow-credentials"] == "true"
            # A stream that fails once started is cut short as before (no second answer).
            with pytest.raises(httpx.RemoteProtocolError):
                with page.stream("GET", "/test-only/broken-stream") as response:
                    assert response.status_code == 200
                    response.read()
            assert page.get("/healthz").status_code == 200
        stranger = httpx.get(f"{server.base_url}/test-only/broken", headers={"Origin": STRANGER}, timeout=5)
        assert stranger.status_code == 500
        assert "access-control-allow-origin" not in stranger.headers
    finally:
        server.stop()
