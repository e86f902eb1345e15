"""The page asks for an API key when the service answers 401, keeps it, and sends it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser.chat_page import ChatPage
from tests.browser.conftest import API_KEY, new_context
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def keyless_page(browser: Browser) -> Iterator[Page]:
    context = new_context(browser, api_key=None)
    yield context.new_page()
    context.close()


def test_key_prompt_appears_on_401_and_the_saved_key_is_used_for_runs(
    keyless_page: Page, service: ServerProcess
) -> None:
    page = keyless_page
    chat = ChatPage(page, service.base_url, api_key=API_KEY)
    page.goto(f"{service.base_url}/")
    dialog = page.get_by_test_id("api-key-dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("needs an API key")

    page.get_by_test_id("api-key-input").fill("wrong-key")
    page.get_by_test_id("api-key-save").click()
    expect(dialog).to_contain_text("not accepted")
    expect(dialog).to_be_visible()

    page.get_by_test_id("api-key-input").fill(API_KEY)
    page.get_by_test_id("api-key-save").click()
    expect(dialog).to_be_hidden()
    expect(page.locator("body")).to_have_attribute("data-ready", "yes")
    assert page.evaluate("localStorage.getItem('agentstream.apiKey')") == API_KEY

    run_id = chat.send("What is 2 + 2?")
    chat.wait_done("completed")
    chat.assert_shows_run_once(run_id)

    # A reload keeps the key: no prompt this time, and the conversation is there.
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "yes")
    expect(dialog).to_be_hidden()
    expect(page.locator(f"[data-testid=conversation-item][data-id='{chat.conversation_id}']")).to_be_visible()
