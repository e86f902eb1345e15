"""A web app on another origin calls the service from Chromium with its user's access token (FACES.md
J-01, J-04): preflighted calls, a run's stream read as it comes with fetch (and resumed with
Last-Event-ID), and with an EventSource through ``?access_token=``; a refusal the page can read; a
page of an origin that is not allowed gets nothing.

The identity provider (tests/support/identity_provider.py) runs in this process, the service as a
uvicorn process allowing the app's origin, and the app's page (signed_in_app.html) is served from a
second loopback origin, and a third that is not allowed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page

from tests.browser.conftest import demo_service, new_context
from tests.support.identity_provider import IdentityProvider
from tests.support.ports import free_port
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

PAGE = (Path(__file__).parent / "signed_in_app.html").read_bytes()


class PageOrigin:
    """``signed_in_app.html`` at ``http://127.0.0.1:<port>/``: an origin of its own."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(PAGE)))
                self.end_headers()
                self.wfile.write(PAGE)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


@pytest.fixture(scope="module")
def app_origin() -> Iterator[PageOrigin]:
    origin = PageOrigin()
    yield origin
    origin.close()


@pytest.fixture(scope="module")
def stranger_origin() -> Iterator[PageOrigin]:
    origin = PageOrigin()
    yield origin
    origin.close()


@pytest.fixture(scope="module")
def signed_in_service(
    tmp_path_factory: pytest.TempPathFactory, idp: IdentityProvider, app_origin: PageOrigin
) -> Iterator[ServerProcess]:
    server = demo_service(
        tmp_path_factory.mktemp("sign-in-service"), **idp.env(), CORS_ALLOW_ORIGINS=app_origin.origin
    )
    yield server
    server.stop()


def open_page(browser: Browser, origin: PageOrigin) -> Iterator[Page]:
    context = new_context(browser, api_key=None)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{origin.origin}/")
    yield page
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def app_page(browser: Browser, app_origin: PageOrigin) -> Iterator[Page]:
    yield from open_page(browser, app_origin)


@pytest.fixture
def stranger_page(browser: Browser, stranger_origin: PageOrigin) -> Iterator[Page]:
    yield from open_page(browser, stranger_origin)


def test_a_page_of_another_origin_reads_a_run_s_stream_with_its_user_s_token(
    app_page: Page, signed_in_service: ServerProcess, idp: IdentityProvider
) -> None:
    base, token = signed_in_service.base_url, idp.token("user-browser")

    read = app_page.evaluate("([b, t]) => askAndRead(b, t, 'What is 17*23?')", [base, token])

    assert read["status"] == 200
    events = read["events"]
    assert events[-1]["event"] == "done"
    assert events[-1]["data"]["status"] == "completed"
    assert "391" in events[-1]["data"]["answer"]
    assert read["reads"] > 1, "the stream came in one piece: it was not read as it streamed"

    # Resumed after its second event, with the Last-Event-ID header (preflighted): the rest, once.
    rest = app_page.evaluate(
        "([b, t, c, id]) => resumeAfter(b, t, c, id)", [base, token, read["conversationId"], events[1]["id"]]
    )
    assert rest["status"] == 200
    assert [e["id"] for e in rest["events"]] == [e["id"] for e in events[2:]]

    # An EventSource cannot send headers: the token goes as ?access_token=.
    again = app_page.evaluate(
        "([b, t, c]) => readWithEventSource(b, t, c)", [base, token, read["conversationId"]]
    )
    assert again["done"] == events[-1]["data"]
    assert again["names"] == [e["event"] for e in events if e["event"] in ("step", "answer", "phase", "done")]


def test_the_page_reads_why_its_token_was_refused(
    app_page: Page, signed_in_service: ServerProcess, idp: IdentityProvider
) -> None:
    expired = idp.token("user-browser", lifetime_s=-3600)
    refusal = app_page.evaluate("([b, t]) => refusal(b, t)", [signed_in_service.base_url, expired])
    assert refusal["status"] == 401
    assert refusal["challenge"].startswith('Bearer error="invalid_token"')
    assert "expired" in refusal["challenge"]
    assert refusal["error"]["message"] == "the access token has expired"


def test_only_a_page_of_an_allowed_origin_can_read_anything(
    app_page: Page, stranger_page: Page, signed_in_service: ServerProcess, idp: IdentityProvider
) -> None:
    call = "([b, t]) => tryToCall(b, t)"
    arguments = [signed_in_service.base_url, idp.token("user-browser")]
    assert app_page.evaluate(call, arguments) == "read"
    assert stranger_page.evaluate(call, arguments) == "blocked: TypeError"
