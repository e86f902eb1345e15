"""A queued run (RUNS.md Q-01) as the page shows it: its place in the queue, then the run itself."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.chat_page import ChatPage
from tests.browser.conftest import API_KEY, demo_service
from tests.support.fake_agents import EchoAgentBehaviour, _last_user_text
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

BUSY = "Keep the only place busy"


class HoldingAgent(EchoAgentBehaviour):
    """Echo agent whose calls for a run asking ``BUSY`` are held until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        reply = super().__call__(body)
        held = _last_user_text(body) == BUSY
        return FakeReply.blocked(self.release, reply, timeout_s=60) if held else reply


@dataclass(frozen=True)
class OnePlace:
    service: ServerProcess
    agent: HoldingAgent


@pytest.fixture(scope="module")
def one_place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnePlace]:
    """The service with room for one run, on a model that holds the run asking ``BUSY``."""
    agent = HoldingAgent()
    with FakeOpenAIServer() as llm:
        llm.set_handler(agent)
        env = {"LLM_BASE_URL": llm.base_url, "LLM_API_KEY": "sk-test", "MAX_ACTIVE_RUNS": "1"}
        server = demo_service(tmp_path_factory.mktemp("one-place"), **env)
        try:
            yield OnePlace(server, agent)
        finally:
            agent.release.set()
            server.stop()


def test_a_queued_run_shows_its_place_and_then_runs(page: Page, one_place: OnePlace) -> None:
    base_url = one_place.service.base_url
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        conv = http.post("/api/conversations").json()["id"]
        busy = http.post(f"/api/conversations/{conv}/runs", json={"message": BUSY})
        assert busy.json()["status"] == "running"
        chat = ChatPage(page, base_url, api_key=API_KEY)
        chat.open()

        run_id = chat.send("What is 17*23?")

        queued = page.get_by_test_id("separator-phase").filter(has_text="Queued")
        expect(queued).to_have_text("Queued (position 1): starts when a worker has room")
        assert http.get(f"/api/runs/{run_id}").json()["status"] == "queued"
        # The place frees: the run starts, and the page shows it to its end.
        assert http.post(f"/api/conversations/{conv}/cancel").status_code == 202
    one_place.agent.release.set()
    chat.wait_done("completed")
    chat.assert_shows_run_once(run_id)
