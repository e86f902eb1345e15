"""Branches on the page (FACES.md B-09) in real Chromium, against the real service and its demo
model: a question edited in place, an answer regenerated, "‹ n/m ›" between the versions (also
after a reload, from the server's state), a fork from a message, a finished run replayed from one
of its step cards (B-06), and the controls while a run is active (B-07)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Locator, Page, expect

from tests.browser.chat_page import RUN_TIMEOUT_MS, ChatPage
from tests.browser.conftest import API_KEY, demo_service
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = "What is 17 * 23 + 4?"
EDITED = "Convert 10 km to miles."


def question(chat: ChatPage, index: int = 0) -> Locator:
    return chat.page.get_by_test_id("question").nth(index)


def answer_controls(chat: ChatPage, run_id: str) -> Locator:
    return chat.page.locator(f"[data-testid=answer-controls][data-run-id='{run_id}']")


def finished_run(chat: ChatPage, run_id: str) -> None:
    """The run is on screen, done, with the controls its branch gets once it has ended."""
    expect(chat.run_view(run_id).get_by_test_id("done-footer")).to_be_visible(timeout=RUN_TIMEOUT_MS)
    expect(answer_controls(chat, run_id)).to_be_visible()


def ask(chat: ChatPage, text: str) -> str:
    run_id = chat.send(text)
    finished_run(chat, run_id)
    return run_id


def run_other_than(chat: ChatPage, *old: str) -> str:
    """The id of the one run on screen once it is none of ``old`` (a new branch's run)."""
    run = chat.page.locator("[data-testid=run][data-run-id]")
    expect(run).to_have_count(1)
    for run_id in old:
        expect(run).not_to_have_attribute("data-run-id", run_id)
    new_id = run.get_attribute("data-run-id")
    assert new_id
    return new_id


def wait_left(chat: ChatPage, conversation_id: str) -> str:
    """The id of the conversation the page went to from ``conversation_id``."""
    expect(chat.page).not_to_have_url(re.compile(re.escape(conversation_id)))
    return chat.conversation_id


def stream_requests(page: Page) -> list[str]:
    """The URLs of the stream requests the page makes from now on."""
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url) if "/stream" in request.url else None)
    return urls


def test_editing_a_question_in_place_asks_it_as_a_new_branch(chat: ChatPage) -> None:
    chat.open()
    first_run = ask(chat, QUESTION)
    expect(question(chat).get_by_test_id("sibling-switcher")).to_have_count(0)
    # Cancel puts the question back as it was.
    question(chat).get_by_test_id("edit-button").click()
    chat.page.get_by_test_id("edit-input").fill("Something else")
    chat.page.get_by_test_id("edit-cancel").click()
    expect(chat.page.get_by_test_id("edit-input")).to_have_count(0)
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION])

    question(chat).get_by_test_id("edit-button").click()
    box = chat.page.get_by_test_id("edit-input")
    expect(box).to_have_value(QUESTION)
    box.fill(EDITED)
    chat.page.get_by_test_id("edit-save").click()

    expect(chat.page.get_by_test_id("user-message")).to_have_text([EDITED])
    edited_run = run_other_than(chat, first_run)
    finished_run(chat, edited_run)
    chat.assert_shows_run_once(edited_run)
    expect(question(chat).get_by_test_id("sibling-position")).to_have_text("2/2")
    expect(question(chat).get_by_test_id("sibling-next")).to_be_disabled()

    question(chat).get_by_test_id("sibling-prev").click()
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION])
    expect(question(chat).get_by_test_id("sibling-position")).to_have_text("1/2")
    finished_run(chat, first_run)
    chat.assert_shows_run_once(first_run)
    expect(chat.run_view(edited_run)).to_have_count(0)


def regenerate(chat: ChatPage, run_id: str) -> str:
    answer_controls(chat, run_id).get_by_test_id("regenerate-button").click()
    new_run = run_other_than(chat, run_id)
    finished_run(chat, new_run)
    return new_run


def test_regenerating_an_answer_adds_a_second_one_and_switching_shows_the_first(chat: ChatPage) -> None:
    chat.open()
    first_run = ask(chat, QUESTION)
    expect(answer_controls(chat, first_run).get_by_test_id("sibling-switcher")).to_have_count(0)

    second_run = regenerate(chat, first_run)

    chat.assert_shows_run_once(second_run)
    controls = answer_controls(chat, second_run)
    expect(controls.get_by_test_id("sibling-position")).to_have_text("2/2")
    # The question is the same one, answered twice: it has no versions of its own.
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION])
    expect(question(chat).get_by_test_id("sibling-switcher")).to_have_count(0)

    controls.get_by_test_id("sibling-prev").click()
    finished_run(chat, first_run)
    expect(chat.run_view(second_run)).to_have_count(0)
    expect(answer_controls(chat, first_run).get_by_test_id("sibling-position")).to_have_text("1/2")
    chat.assert_shows_run_once(first_run)


def test_the_switched_branch_is_the_servers_after_a_reload(chat: ChatPage) -> None:
    chat.open()
    first_run = ask(chat, QUESTION)
    second_run = regenerate(chat, first_run)
    answer_controls(chat, second_run).get_by_test_id("sibling-prev").click()
    finished_run(chat, first_run)

    chat.page.reload()
    expect(chat.page.locator("body")).to_have_attribute("data-ready", "yes")
    finished_run(chat, first_run)
    expect(chat.run_view(second_run)).to_have_count(0)
    expect(answer_controls(chat, first_run).get_by_test_id("sibling-position")).to_have_text("1/2")
    chat.assert_shows_run_once(first_run)

    answer_controls(chat, first_run).get_by_test_id("sibling-next").click()
    finished_run(chat, second_run)
    chat.page.reload()
    expect(chat.page.locator("body")).to_have_attribute("data-ready", "yes")
    finished_run(chat, second_run)
    expect(answer_controls(chat, second_run).get_by_test_id("sibling-position")).to_have_text("2/2")
    chat.assert_shows_run_once(second_run)


def test_fork_opens_a_new_conversation_with_the_path_to_the_message(chat: ChatPage) -> None:
    chat.open()
    first_run = ask(chat, QUESTION)
    ask(chat, EDITED)
    original = chat.conversation_id
    answer = chat.stored_run(first_run).done["answer"]

    answer_controls(chat, first_run).get_by_test_id("fork-button").click()

    forked = wait_left(chat, original)
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION])
    expect(chat.page.locator(f"[data-testid=conversation-item][data-id='{forked}']")).to_be_visible()
    expect(chat.page.locator(f"[data-testid=conversation-item][data-id='{forked}']")).to_have_attribute(
        "aria-current", "page"
    )
    # The copies belong to no run of the new conversation: the answer is its stored text.
    bubble = chat.page.get_by_test_id("assistant-message")
    expect(bubble).to_have_count(1)
    assert bubble.locator(".markdown").inner_html() == chat.markdown_html(answer)
    expect(chat.page.get_by_test_id("run")).to_have_count(0)

    # The forked conversation goes on from there; the original keeps both questions.
    run_id = ask(chat, EDITED)
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION, EDITED])
    chat.assert_shows_run_once(run_id)
    chat.page.locator(f"[data-testid=conversation-item][data-id='{original}']").click()
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION, EDITED])
    expect(chat.page.get_by_test_id("run")).to_have_count(2)


def test_fork_from_a_question_keeps_it_unanswered(chat: ChatPage) -> None:
    chat.open()
    ask(chat, QUESTION)
    ask(chat, EDITED)
    original = chat.conversation_id

    question(chat, 1).get_by_test_id("fork-button").click()

    wait_left(chat, original)
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION, EDITED])
    expect(chat.page.get_by_test_id("assistant-message")).to_have_count(1)
    expect(chat.page.get_by_test_id("run")).to_have_count(0)

    # Its last question waits for an answer: asked for, a run answers it.
    answer = chat.page.get_by_test_id("answer-controls").last.get_by_test_id("regenerate-button")
    expect(answer).to_have_text("Answer")
    answer.click()
    run = chat.page.locator("[data-testid=run][data-run-id]")
    expect(run).to_have_count(1)
    finished_run(chat, run.get_attribute("data-run-id") or "")
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION, EDITED])


def test_replaying_a_run_from_a_step_card_streams_a_sibling_that_restates_the_steps(chat: ChatPage) -> None:
    chat.open()
    first_run = ask(chat, QUESTION)
    card = chat.run_view(first_run).locator("[data-testid=tool-card][data-tool=calculator]")
    source = chat.stored_run(first_run)
    step_done = next(
        ev["id"]
        for ev in source.events
        if ev["data"].get("type") == "iteration" and ev["data"]["status"] == "done"
    )
    expect(card).to_have_attribute("data-last-event-id", step_done)
    streams = stream_requests(chat.page)

    card.locator("summary").click()
    card.get_by_test_id("replay-button").click()

    replay_run = run_other_than(chat, first_run)
    finished_run(chat, replay_run)
    assert streams, "the page did not follow the new run's stream"
    record = chat.assert_shows_run_once(replay_run)
    first = record.events[0]
    assert first["event"] == "phase"
    assert first["data"] == {
        "phase": "replay",
        "source_run_id": first_run,
        "after": step_done,
        "run_id": replay_run,
    }
    view = chat.run_view(replay_run)
    expect(view.get_by_test_id("separator-replay")).to_have_text("Replayed from step 1 of an earlier answer")
    # The calculator step is restated (its result reused), after the note.
    restated = view.locator("[data-testid=tool-card][data-tool=calculator]")
    expect(restated).to_have_count(1)
    expect(restated.get_by_test_id("tool-observation")).to_contain_text("395")
    timeline = [entry["testid"] for entry in chat.timeline(replay_run)]
    assert timeline.index("separator-replay") < timeline.index("tool-card"), timeline
    expect(answer_controls(chat, replay_run).get_by_test_id("sibling-position")).to_have_text("2/2")

    answer_controls(chat, replay_run).get_by_test_id("sibling-prev").click()
    finished_run(chat, first_run)
    chat.assert_shows_run_once(first_run)


# ---- while a run is active ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def approval_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The calculator waits for a person: a run stays active as long as a test needs."""
    tmp: Path = tmp_path_factory.mktemp("branches-approval-service")
    server = demo_service(tmp, REQUIRE_APPROVAL="calculator")
    yield server
    server.stop()


@pytest.fixture
def waiting_chat(page: Page, approval_service: ServerProcess) -> ChatPage:
    return ChatPage(page, approval_service.base_url, api_key=API_KEY)


def approve_and_finish(chat: ChatPage, run_id: str) -> None:
    card = chat.run_view(run_id).get_by_test_id("approval-card")
    card.get_by_test_id("approve-button").click()
    finished_run(chat, run_id)


def test_controls_are_disabled_while_a_run_is_active(waiting_chat: ChatPage) -> None:
    chat = waiting_chat
    chat.open()
    first_run = chat.send(QUESTION)
    approve_and_finish(chat, first_run)
    second_run = chat.send(EDITED + " And what is 2+2?")
    expect(chat.run_view(second_run).get_by_test_id("approval-card")).to_be_visible()

    first = question(chat)
    controls = [
        first.get_by_test_id("edit-button"),
        first.get_by_test_id("fork-button"),
        answer_controls(chat, first_run).get_by_test_id("regenerate-button"),
        answer_controls(chat, first_run).get_by_test_id("fork-button"),
        chat.run_view(first_run).get_by_test_id("replay-button").first,
    ]
    for control in controls:
        expect(control).to_be_disabled()

    approve_and_finish(chat, second_run)
    for control in controls:
        expect(control).to_be_enabled()
    # Enabled again, they work: the first answer is regenerated (and waits for its approval).
    answer_controls(chat, first_run).get_by_test_id("regenerate-button").click()
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION])
    third_run = run_other_than(chat, first_run, second_run)
    approve_and_finish(chat, third_run)
    expect(answer_controls(chat, third_run).get_by_test_id("sibling-position")).to_have_text("2/2")


def test_an_action_the_service_refuses_shows_the_toast(waiting_chat: ChatPage) -> None:
    chat = waiting_chat
    chat.open()
    run_id = chat.send(QUESTION)
    approve_and_finish(chat, run_id)

    # Another client starts a run the page does not know of yet: the service answers 409.
    response = httpx.post(
        f"{chat.base_url}/api/conversations/{chat.conversation_id}/runs",
        json={"message": EDITED + " And what is 2+2?"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    answer_controls(chat, run_id).get_by_test_id("regenerate-button").click()

    toast = chat.page.get_by_test_id("toast")
    expect(toast).to_be_visible()
    expect(toast).to_contain_text("A run is working in this conversation")
    expect(toast).to_have_attribute("data-kind", "error")
    expect(chat.run_view(run_id)).to_be_visible()
