"""A user's runs in the browser: tool cards, the streamed answer, follow-ups, cancel, and resuming."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import BrowserContext, Page, Route, expect

from tests.browser.chat_page import ChatPage

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is 17 * 23 + 4?"
RICH_QUESTION = "What is 17 * 23 + 4? Convert 10 km to miles. Write a report about the solar system."
"""Three tool calls, one of them making a Markdown artifact, and a longer answer."""


def test_run_shows_tool_cards_streamed_answer_and_done_footer(chat: ChatPage, tmp_path: Path) -> None:
    chat.open()
    run_id = chat.send(RICH_QUESTION)
    footer = chat.wait_done("completed")

    record = chat.assert_shows_run_once(run_id)
    assert record.count("step", type="iteration", status="start") >= 1
    assert record.streamed_answer == record.done["answer"]
    expect(chat.tool_cards().first).to_contain_text(
        next(ev["data"]["tool_name"] for ev in record.events if ev["data"].get("type") == "iteration")
    )
    usage = record.done["usage"]
    expect(footer).to_contain_text(f"{record.done['iterations']} iteration")
    expect(footer).to_contain_text(f"{usage['total_tokens']:,} token")
    expect(footer).to_contain_text(f"{usage['llm_calls']} LLM call")
    # The run is over: the composer is back and the conversation is listed.
    expect(chat.page.get_by_test_id("message-input")).to_be_visible()
    expect(chat.page.get_by_test_id("interrupt-box")).to_be_hidden()
    expect(
        chat.page.locator(f"[data-testid=conversation-item][data-id='{chat.conversation_id}']")
    ).to_be_visible()

    report = chat.page.locator("[data-testid=tool-card][data-tool=write_report]")
    report.locator("summary").click()
    expect(report.get_by_test_id("artifact").locator("h1")).to_be_visible()
    chat.page.set_viewport_size({"width": 1280, "height": 1180})
    chat.page.get_by_test_id("messages").evaluate("(box) => { box.scrollTop = box.scrollHeight; }")
    # The README's picture is refreshed on demand (UPDATE_SCREENSHOT=1), so a test run leaves the tree clean.
    target = ROOT / "docs" / "screenshot.png" if os.environ.get("UPDATE_SCREENSHOT") else tmp_path / "run.png"
    chat.page.screenshot(path=str(target))
    assert target.stat().st_size > 10_000


def test_follow_up_sent_while_the_agent_works_shows_up_in_the_run(chat: ChatPage) -> None:
    follow_up = "Please also double the result."
    chat.open()
    run_id = chat.send(QUESTION)
    chat.page.get_by_test_id("interrupt-input").fill(follow_up)
    chat.page.get_by_test_id("interrupt-button").click()

    expect(chat.page.get_by_test_id("composer-hint")).to_contain_text("queued")
    footer = chat.wait_done()
    record = chat.assert_shows_run_once(run_id)
    expect(chat.page.get_by_test_id("queued-followup")).to_have_count(0)
    # The loop either took the follow-up (an inject event) or it came too late and the footer says so.
    if record.count("inject"):
        expect(chat.page.get_by_test_id("inject-bubble")).to_contain_text(follow_up)
    else:
        assert follow_up in record.done["pending_injections"]
        expect(footer.get_by_test_id("done-pending")).to_contain_text(follow_up)


def test_cancel_stops_the_run_and_the_footer_says_cancelled(chat: ChatPage) -> None:
    chat.open()
    run_id = chat.send(QUESTION)
    chat.page.get_by_test_id("cancel-button").click()

    footer = chat.wait_done("cancelled")
    expect(footer.get_by_test_id("done-status")).to_have_text("cancelled")
    chat.assert_shows_run_once(run_id)
    expect(chat.page.get_by_test_id("message-input")).to_be_visible()


def stream_cursors(page: Page) -> list[list[str]]:
    """The ``after`` values of every stream request the page makes from now on ([] for none)."""
    cursors: list[list[str]] = []
    page.on(
        "request",
        lambda request: (
            cursors.append(parse_qs(urlparse(request.url).query).get("after", []))
            if "/stream" in request.url
            else None
        ),
    )
    return cursors


def test_reload_mid_run_resumes_without_showing_anything_twice(chat: ChatPage) -> None:
    chat.open()
    run_id = chat.send(RICH_QUESTION)
    expect(chat.thinking_cards().first).to_be_visible()
    conversation_id = chat.conversation_id
    cursors = stream_cursors(chat.page)

    chat.page.reload()
    expect(chat.page.locator("body")).to_have_attribute("data-ready", "yes")
    assert chat.conversation_id == conversation_id
    chat.wait_done("completed")
    chat.assert_shows_run_once(run_id)
    # The reloaded page replayed its snapshot and asked only for what came after it.
    assert cursors and cursors[0], cursors


def test_reload_while_the_answer_streams_keeps_one_whole_answer(chat: ChatPage) -> None:
    chat.open()
    run_id = chat.send(RICH_QUESTION)
    expect(chat.answers().first).to_be_visible(timeout=30_000)

    chat.page.reload()
    chat.wait_done("completed")
    chat.assert_shows_run_once(run_id)


def test_second_tab_opened_mid_run_streams_the_run_from_its_start(
    chat: ChatPage, context: BrowserContext
) -> None:
    chat.open()
    run_id = chat.send(RICH_QUESTION)
    expect(chat.thinking_cards().first).to_be_visible()

    # A new tab has no sessionStorage snapshot: it must stream the active run from its first event.
    other = ChatPage(context.new_page(), chat.base_url, api_key=chat.api_key)
    cursors = stream_cursors(other.page)
    other.open(chat.conversation_id)
    other.wait_done("completed")
    chat.wait_done("completed")
    other.assert_shows_run_once(run_id)
    chat.assert_shows_run_once(run_id)
    assert cursors and cursors[0] == [], cursors


def test_dropped_stream_reconnects_after_the_last_event_id(chat: ChatPage) -> None:
    stream_urls: list[str] = []

    def cut_first_stream(route: Route) -> None:
        stream_urls.append(route.request.url)
        if len(stream_urls) > 1:
            route.continue_()
            return
        # Let the first connection deliver only part of the run, then end as a dropped connection would.
        response = route.fetch(timeout=30_000)
        frames = response.text().split("\n\n")
        route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            body="\n\n".join(frames[: max(2, len(frames) // 2)]) + "\n\n",
        )

    chat.page.route("**/api/conversations/*/stream*", cut_first_stream)
    chat.open()
    run_id = chat.send(QUESTION)
    chat.wait_done("completed")

    assert len(stream_urls) >= 2, stream_urls
    assert "after" not in parse_qs(urlparse(stream_urls[0]).query)
    assert parse_qs(urlparse(stream_urls[1]).query)["after"]
    chat.assert_shows_run_once(run_id)


def test_finished_conversation_reopens_with_its_steps_and_answer(chat: ChatPage) -> None:
    chat.open()
    run_id = chat.send(QUESTION)
    chat.wait_done("completed")
    conversation_id = chat.conversation_id

    chat.page.get_by_test_id("new-conversation").click()
    expect(chat.page.get_by_test_id("run")).to_have_count(0)
    chat.page.locator(f"[data-testid=conversation-item][data-id='{conversation_id}']").click()
    chat.wait_done("completed")
    expect(chat.page.get_by_test_id("user-message")).to_have_text([QUESTION])
    chat.assert_shows_run_once(run_id)
