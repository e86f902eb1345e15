"""A queued run (RUNS.md Q-01) as the page shows it: its place in the queue, then the run itself."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.chat_page import ChatPage
from tests.browser.conftest import API_KEY, demo_service
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The demo service with room for one run, whose words come slowly enough to keep it busy."""
    server = demo_service(tmp_path_factory.mktemp("one-place"), DEMO_DELAY_S="0.2", MAX_ACTIVE_RUNS="1")
    yield server
    server.stop()


def test_a_queued_run_shows_its_place_and_then_runs(page: Page, one_place: ServerProcess) -> None:
    with httpx.Client(base_url=one_place.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        conv = http.post("/api/conversations").json()["id"]
        busy = http.post(f"/api/conversations/{conv}/runs", json={"message": "What time is it in Tokyo?"})
        assert busy.json()["status"] == "running"
        chat = ChatPage(page, one_place.base_url, api_key=API_KEY)
        chat.open()

        run_id = chat.send("What is 17*23?")

        queued = page.get_by_test_id("separator-phase").filter(has_text="Queued")
        expect(queued).to_have_text("Queued (position 1): starts when a worker has room")
        assert http.get(f"/api/runs/{run_id}").json()["status"] == "queued"
        # The place frees: the run starts, and the page shows it to its end.
        assert http.post(f"/api/conversations/{conv}/cancel").status_code == 202
    chat.wait_done("completed")
    chat.assert_shows_run_once(run_id)
