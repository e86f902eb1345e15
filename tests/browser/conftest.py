"""Fixtures for the browser tests: Debian's Chromium driven by Playwright against a real uvicorn process.

The service runs as ``python -m uvicorn app.main:create_app --factory`` with a temporary SQLite file,
the built-in demo model and one API key, which every page but the key-prompt test already holds.
Chromium is the system one (no browser download ever happens). Under pytest-xdist every browser
test runs on the same worker (tests/support/scheduling.py), so one Chromium and one service serve
them all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, sync_playwright

from tests.browser.chat_page import ChatPage
from tests.support.server import ServerProcess

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEMO_DELAY_S = "0.03"
"""Slow enough that a follow-up, a cancel or a reload lands while the answer still streams."""
API_KEY = "browser-test-key"


# Package scope, not session: Playwright's sync API keeps an event loop running in the main thread
# while it is open, and the asyncio tests collected after this package need it closed again.
@pytest.fixture(scope="package")
def playwright_driver() -> Iterator[Playwright]:
    if not Path(CHROMIUM).exists():
        message = f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM_PATH)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="package")
def browser(playwright_driver: Playwright) -> Iterator[Browser]:
    browser = playwright_driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


def demo_service(tmp: Path, **env: str) -> ServerProcess:
    """A started service on a SQLite file in ``tmp``, the demo model and ``API_KEY``; ``env`` on top."""
    defaults = {
        "DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'agentstream.db'}",
        "LLM_BASE_URL": "",
        "REDIS_URL": "",
        "API_KEYS": f"alice:{API_KEY}",
        "DEMO_DELAY_S": DEMO_DELAY_S,
    }
    return ServerProcess({**defaults, **env}).start(tmp / "service.log")


@pytest.fixture(scope="package")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = demo_service(tmp_path_factory.mktemp("browser-service"))
    yield server
    server.stop()


def new_context(browser: Browser, api_key: str | None) -> BrowserContext:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(20_000)
    if api_key is not None:
        context.add_init_script(f"localStorage.setItem('agentstream.apiKey', {api_key!r})")
    return context


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    """A browser profile that already holds the service's API key."""
    context = new_context(browser, API_KEY)
    yield context
    context.close()


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    # A sandboxed artifact frame has no rights at all; Chromium may report its denied storage
    # access as a page error. That denial is what the sandbox is for, not a fault of the page.
    errors = [e for e in errors if "The document is sandboxed" not in e]
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def chat(page: Page, service: ServerProcess) -> ChatPage:
    return ChatPage(page, service.base_url, api_key=API_KEY)
