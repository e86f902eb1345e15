"""The approval card (RUNS.md A-07) in real Chromium, against the real service and its demo model
with approval required for the calculator: approve, approve edited arguments, deny with a reason,
and a reload while the run waits. The inbox lists what waits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Locator, Page, expect

from tests.browser.chat_page import ChatPage
from tests.browser.conftest import API_KEY, DEMO_DELAY_S
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = "What is 17*23?"


@pytest.fixture(scope="module")
def approval_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp: Path = tmp_path_factory.mktemp("approval-service")
    env = {
        "DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'agentstream.db'}",
        "LLM_BASE_URL": "",
        "REDIS_URL": "",
        "API_KEYS": f"alice:{API_KEY}",
        "DEMO_DELAY_S": DEMO_DELAY_S,
        "REQUIRE_APPROVAL": "calculator",
    }
    server = ServerProcess(env).start(tmp / "service.log")
    yield server
    server.stop()


@pytest.fixture
def chat(page: Page, approval_service: ServerProcess) -> ChatPage:
    return ChatPage(page, approval_service.base_url, api_key=API_KEY)


def waiting_card(chat: ChatPage) -> Locator:
    chat.open()
    chat.send(QUESTION)
    card = chat.page.get_by_test_id("approval-card").last
    expect(card).to_be_visible()
    expect(card).to_have_attribute("data-state", "pending")
    expect(card.get_by_test_id("approval-tool")).to_have_text("calculator")
    return card


def calculator_observation(chat: ChatPage) -> str:
    card = chat.page.locator("[data-testid=tool-card][data-tool=calculator]").last
    return card.get_by_test_id("tool-observation").text_content() or ""


def test_approving_the_card_runs_the_call_and_the_run_ends(chat: ChatPage) -> None:
    card = waiting_card(chat)
    args = card.get_by_test_id("approval-args").input_value()
    assert '"expression"' in args
    inbox = chat.page.get_by_test_id("inbox")
    expect(inbox).to_be_visible()
    expect(inbox.get_by_test_id("inbox-item")).to_have_count(1)
    expect(chat.page.get_by_test_id("run-pill")).to_have_text("Waiting for approval")

    card.get_by_test_id("approve-button").click()

    expect(card).to_have_attribute("data-state", "approved")
    chat.wait_done("completed")
    assert "391" in calculator_observation(chat)
    expect(card.get_by_test_id("approve-button")).to_be_disabled()
    expect(inbox).to_be_hidden()


def test_edited_arguments_run_as_edited(chat: ChatPage) -> None:
    card = waiting_card(chat)

    card.get_by_test_id("approval-args").fill('{"expression": "2+2"}')
    card.get_by_test_id("approve-button").click()

    chat.wait_done("completed")
    expect(card).to_have_attribute("data-state", "approved")
    assert calculator_observation(chat).strip().endswith("4")


def test_bad_json_is_refused_in_the_page_and_the_card_stays_pending(chat: ChatPage) -> None:
    card = waiting_card(chat)

    card.get_by_test_id("approval-args").fill('{"expression": ')
    card.get_by_test_id("approve-button").click()

    expect(card.get_by_test_id("approval-error")).to_contain_text("not valid JSON")
    expect(card).to_have_attribute("data-state", "pending")
    card.get_by_test_id("approval-args").fill('{"expression": 5}')
    card.get_by_test_id("approve-button").click()
    expect(card.get_by_test_id("approval-error")).to_contain_text("parameters")
    expect(card).to_have_attribute("data-state", "pending")
    card.get_by_test_id("deny-button").click()
    chat.wait_done("completed")


def test_denying_with_a_reason_tells_the_model_and_the_run_ends(chat: ChatPage) -> None:
    card = waiting_card(chat)

    card.get_by_test_id("approval-reason").fill("use mental arithmetic")
    card.get_by_test_id("deny-button").click()

    expect(card).to_have_attribute("data-state", "denied")
    expect(card.get_by_test_id("approval-outcome")).to_contain_text("use mental arithmetic")
    chat.wait_done("completed")
    observation = calculator_observation(chat)
    assert "denied" in observation and "use mental arithmetic" in observation


def test_a_reload_while_the_run_waits_shows_the_card_again_and_it_still_works(chat: ChatPage) -> None:
    waiting_card(chat)
    conversation_id = chat.conversation_id

    chat.page.reload()
    expect(chat.page.locator("body")).to_have_attribute("data-ready", "yes")

    card = chat.page.get_by_test_id("approval-card").last
    expect(card).to_be_visible()
    expect(card).to_have_attribute("data-state", "pending")
    card.get_by_test_id("approve-button").click()
    chat.wait_done("completed")
    assert "391" in calculator_observation(chat)
    detail = httpx.get(
        f"{chat.base_url}/api/conversations/{conversation_id}",
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert detail["pending_approvals"] == [] and detail["active_run_id"] is None
