"""The page asks for an API key when the service answers 401, keeps it, and sends it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.browser.chat_page import ChatPage
from tests.browser.conftest import service_env
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

KEY = "browser-test-key"


@pytest.fixture(scope="module")
def keyed_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp: Path = tmp_path_factory.mktemp("keyed-service")
    server = ServerProcess(service_env(tmp, API_KEYS=f"alice:{KEY}")).start(tmp / "service.log")
    yield server
    server.stop()


def test_key_prompt_appears_on_401_and_the_saved_key_is_used_for_runs(
    page: Page, keyed_service: ServerProcess
) -> None:
    chat = ChatPage(page, keyed_service.base_url, api_key=KEY)
    page.goto(f"{keyed_service.base_url}/")
    dialog = page.get_by_test_id("api-key-dialog")
    expect(dialog).to_be_visible()

    page.get_by_test_id("api-key-input").fill("wrong-key")
    page.get_by_test_id("api-key-save").click()
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("not accepted")

    page.get_by_test_id("api-key-input").fill(KEY)
    page.get_by_test_id("api-key-save").click()
    expect(dialog).to_be_hidden()
    expect(page.locator("body")).to_have_attribute("data-ready", "yes")
    assert page.evaluate("localStorage.getItem('agentstream.apiKey')") == KEY

    run_id = chat.send("What is 2 + 2?")
    chat.wait_done("completed")
    chat.assert_shows_run_once(run_id)

    # A reload keeps the key: no prompt this time.
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "yes")
    expect(dialog).to_be_hidden()
    expect(page.get_by_test_id("conversation-item")).to_have_count(1)
