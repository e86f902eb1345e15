"""The model picker for new conversations (issue 16): shown with two models or more, the default
chosen; the model picked is the one the new conversation's runs go to. Hidden with one model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.chat_page import ChatPage
from tests.browser.conftest import API_KEY
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

ANSWER_A = ["Model ", "A ", "answers ", "391."]
ANSWER_B = ["Model ", "B ", "answers ", "391."]
QUESTION = "What is 17 * 23?"


@dataclass(frozen=True)
class TwoModels:
    service: ServerProcess
    a: FakeOpenAIServer
    b: FakeOpenAIServer


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoModels]:
    """The service as a uvicorn process with models ``a`` (the default) and ``b``, each on a fake
    provider of its own in this process, and ``flaky``, whose provider is down, falling back to ``b``."""
    tmp = tmp_path_factory.mktemp("browser-models")
    with FakeOpenAIServer() as a, FakeOpenAIServer() as b, FakeOpenAIServer() as down:
        a.set_handler(EchoAgentBehaviour(ANSWER_A))
        b.set_handler(EchoAgentBehaviour(ANSWER_B))
        down.set_handler(lambda body: FakeReply.error(503))
        models = [
            {"name": "a", "base_url": a.base_url, "api_key": "sk-a", "model": "provider-a", "max_retries": 0},
            {"name": "b", "base_url": b.base_url, "api_key": "sk-b", "model": "provider-b", "max_retries": 0},
            {
                "name": "flaky",
                "base_url": down.base_url,
                "api_key": "sk-f",
                "model": "provider-f",
                "max_retries": 0,
                "fallback": "b",
            },
        ]
        env = {
            "DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'agentstream.db'}",
            "LLM_BASE_URL": "",
            "LLM_MODELS": json.dumps(models),
            "REDIS_URL": "",
            "API_KEYS": f"alice:{API_KEY}",
        }
        service = ServerProcess(env).start(tmp / "service.log")
        try:
            yield TwoModels(service, a, b)
        finally:
            service.stop()


def conversation(base_url: str, conversation_id: str) -> dict[str, Any]:
    response = httpx.get(
        f"{base_url}/api/conversations/{conversation_id}",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def test_with_two_models_the_picker_shows_both_and_a_question_on_b_runs_on_b(
    page: Page, two_models: TwoModels
) -> None:
    chat = ChatPage(page, two_models.service.base_url, api_key=API_KEY)
    chat.open()
    picker = page.get_by_test_id("model-picker")

    expect(picker).to_be_visible()
    expect(picker.locator("option")).to_have_text(["a (default)", "b", "flaky"])
    expect(picker).to_have_value("a")

    picker.select_option("b")
    # Not ``chat.send``: it waits for the run to show as running, and the fake answers at once.
    page.get_by_test_id("message-input").fill(QUESTION)
    page.get_by_test_id("send-button").click()
    chat.wait_done("completed")
    run_id = page.locator("[data-testid=run][data-run-id]").last.get_attribute("data-run-id")
    assert run_id

    record = chat.assert_shows_run_once(run_id)
    assert record.done["model"] == "b"
    assert record.done["answer"] == "".join(ANSWER_B)
    assert conversation(chat.base_url, chat.conversation_id)["agent"]["model"] == "b"
    assert two_models.b.requests
    assert two_models.a.requests == []


def test_a_call_that_falls_back_shows_which_model_gave_way_to_which(
    page: Page, two_models: TwoModels
) -> None:
    chat = ChatPage(page, two_models.service.base_url, api_key=API_KEY)
    chat.open()
    page.get_by_test_id("model-picker").select_option("flaky")
    page.get_by_test_id("message-input").fill(QUESTION)
    page.get_by_test_id("send-button").click()
    chat.wait_done("completed")

    expect(page.get_by_test_id("separator-phase").filter(has_text="unavailable").first).to_have_text(
        "Model flaky unavailable: falling back to b"
    )
    run_id = page.locator("[data-testid=run][data-run-id]").last.get_attribute("data-run-id")
    assert run_id
    assert chat.assert_shows_run_once(run_id).done["answer"] == "".join(ANSWER_B)


def test_with_one_model_the_picker_is_hidden_and_conversations_take_the_default(
    chat: ChatPage, service: ServerProcess
) -> None:
    chat.open()
    # The page asked for the models (the list came back) before deciding to hide the picker.
    expect(chat.page.locator("[data-testid=model-picker] option")).to_have_count(1)

    expect(chat.page.locator("#model-picker-label")).to_be_hidden()
    chat.page.get_by_test_id("new-conversation").click()
    expect(chat.page).to_have_url(re.compile(r"#/c/."))
    assert "model" not in conversation(service.base_url, chat.conversation_id)["agent"]
