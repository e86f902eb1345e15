"""A run carried on by another worker (RUNS.md R-03, R-04), as the page shows it.

The demo model never loses its worker, so these tests serve the page a recorded run through
``page.route``, the way the service would: the conversation names the run active until its ``done``
went out, the stream sends the events after the page's cursor (holding the connection open when
there is nothing new yet), and a finished run's events come from ``/api/runs/{id}/events``.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, Route, expect

from app.streaming.bus import parse_cursor
from tests.browser.chat_page import ChatPage

pytestmark = pytest.mark.slow

RUN_ID = "run_resumed_demo"
QUESTION = "What is 17 * 23, and how far is 10 km in miles?"
USAGE = {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70, "llm_calls": 4}


def ev(cursor: str, event: str, **data: Any) -> dict[str, Any]:
    return {"id": cursor, "event": event, "data": {**data, "run_id": RUN_ID}}


def tool_start(cursor: str, iteration: int, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    return ev(
        cursor, "step", type="iteration", status="start", iteration=iteration, tool_name=tool, tool_args=args
    )


def tool_done(cursor: str, iteration: int, tool: str, observation: str) -> dict[str, Any]:
    return ev(
        cursor,
        "step",
        type="iteration",
        status="done",
        iteration=iteration,
        tool_name=tool,
        observation=observation,
        error=None,
        iter_elapsed=0.02,
    )


def thinking(cursor: str, iteration: int, reasoning: str | None = None) -> dict[str, Any]:
    if reasoning is None:
        return ev(cursor, "step", type="thinking", status="start", iteration=iteration)
    return ev(cursor, "step", type="thinking", status="done", iteration=iteration, reasoning=reasoning)


def delta(cursor: str, content: str) -> dict[str, Any]:
    return ev(cursor, "answer", status="delta", content=content)


def resumed(cursor: str, attempt: int, after: str) -> dict[str, Any]:
    return ev(cursor, "phase", phase="resumed", attempt=attempt, after=after)


def done(cursor: str, answer: str, iterations: int) -> dict[str, Any]:
    return ev(
        cursor,
        "done",
        answer=answer,
        iterations=iterations,
        usage=USAGE,
        elapsed=9.5,
        status="completed",
        error=None,
        pending_injections=[],
    )


CHECKPOINT = "1733150000000-4"
"""The last event the checkpoint covers. The lost attempt's events are ``-10`` and on in the same
millisecond: before it as strings, after it as cursors."""
NEW_ANSWER = ["17 × 23 = **391**", ", and 10 km is about 6.21 mi."]
STALE_ANSWER = ["Stale partial ", "answer of the first attempt"]
RUN_RESUMED_ONCE = [
    ev("1733149999999-7", "phase", phase="selecting_tools", total_tools=3),
    thinking("1733150000000-0", 1),
    thinking("1733150000000-1", 1, "Multiply first."),
    tool_start("1733150000000-2", 1, "calculator", {"expression": "17*23"}),
    tool_done(CHECKPOINT, 1, "calculator", "391"),
    # Work after the checkpoint: the worker dies while the answer streams.
    thinking("1733150000000-10", 2),
    thinking("1733150000000-11", 2, "Now convert the distance."),
    tool_start("1733150000000-12", 2, "unit_convert", {"value": 10, "from": "km", "to": "mi"}),
    tool_done("1733150000000-13", 2, "unit_convert", "6.21 mi"),
    ev("1733150000000-14", "step", type="answer", status="start"),
    ev("1733150000000-15", "answer", status="start"),
    delta("1733150000000-16", STALE_ANSWER[0]),
    delta("1733150000000-17", STALE_ANSWER[1]),
    # Another worker carries the run on from the checkpoint.
    resumed("1733150009000-0", 2, CHECKPOINT),
    thinking("1733150009000-1", 2),
    thinking("1733150009000-2", 2, "Now convert the distance."),
    tool_start("1733150009000-3", 2, "unit_convert", {"value": 10, "from": "km", "to": "mi"}),
    tool_done("1733150009000-4", 2, "unit_convert", "6.21 mi"),
    ev("1733150009000-5", "step", type="answer", status="start"),
    ev("1733150009000-6", "answer", status="start"),
    delta("1733150009000-7", NEW_ANSWER[0]),
    delta("1733150009000-8", NEW_ANSWER[1]),
    ev("1733150009000-9", "answer", status="done"),
    done("1733150009000-10", "".join(NEW_ANSWER), iterations=2),
]
NEW_ATTEMPT_STARTED = 15
"""How many events of RUN_RESUMED_ONCE are out when the new attempt has only started thinking."""

EXPECTED_TIMELINE = [
    {"testid": "separator-phase", "event": "1733149999999-7", "lost": False, "hidden": False},
    {"testid": "thinking-card", "event": "1733150000000-0", "lost": False, "hidden": False},
    {"testid": "tool-card", "event": "1733150000000-2", "lost": False, "hidden": False},
    {"testid": "thinking-card", "event": "1733150000000-10", "lost": True, "hidden": False},
    {"testid": "tool-card", "event": "1733150000000-12", "lost": True, "hidden": False},
    {"testid": "resumed", "event": "1733150009000-0", "lost": False, "hidden": False},
    {"testid": "thinking-card", "event": "1733150009000-1", "lost": False, "hidden": False},
    {"testid": "tool-card", "event": "1733150009000-3", "lost": False, "hidden": False},
    {"testid": "answer", "event": None, "lost": False, "hidden": False},
    {"testid": "done-footer", "event": None, "lost": False, "hidden": False},
]


def sse_frames(events: list[dict[str, Any]]) -> str:
    return "".join(f"id: {e['id']}\nevent: {e['event']}\ndata: {json.dumps(e['data'])}\n\n" for e in events)


class RecordedRun:
    """The service's side of one run whose events are already written, published up to a point."""

    def __init__(self, page: Page, conversation_id: str, events: list[dict[str, Any]]) -> None:
        self.conversation_id = conversation_id
        self.events = events
        self.published = len(events)
        self.ended = False
        """Whether the stream has sent the run's ``done``: from then on the conversation has no
        active run and the page reads the run's stored events instead."""
        self.stream_cursors: list[str | None] = []
        self._waiting: list[Route] = []
        page.route(f"**/api/conversations/{conversation_id}", self._conversation)
        page.route(f"**/api/conversations/{conversation_id}/stream*", self._stream)
        page.route(f"**/api/runs/{RUN_ID}/events", self._stored_events)

    def publish_until(self, count: int) -> None:
        self.published = count

    def publish_the_rest(self) -> None:
        """Publish every event and answer the page's open stream request with the new ones."""
        self.published = len(self.events)
        # Only the newest waiting request can still be open: the older ones came from the page
        # as it was before a reload, and went with it.
        if self._waiting:
            route = self._waiting[-1]
            self._waiting.clear()
            self._answer_stream(route)

    def _conversation(self, route: Route) -> None:
        if route.request.method != "GET":
            route.continue_()
            return
        try:
            response = route.fetch()
            body = response.json()
            body["active_run_id"] = None if self.ended else RUN_ID
            body["messages"] = [
                {
                    "role": "user",
                    "content": QUESTION,
                    "run_id": RUN_ID,
                    "pinned": False,
                    "created_at": body["created_at"],
                }
            ]
            route.fulfill(response=response, json=body)
        except PlaywrightError:
            # The page closed while the service answered: a test that ends at the run's done
            # leaves the page reloading its branch (FACES.md B-09), and nobody reads the answer.
            # (Were the page still open, it would show no conversation and the test would fail.)
            return

    def _stream(self, route: Route) -> None:
        after = parse_qs(urlparse(route.request.url).query).get("after", [None])[0]
        self.stream_cursors.append(after)
        if self._pending(after):
            self._answer_stream(route)
        else:
            # Nothing new yet: the connection stays open, as the service's would.
            self._waiting.append(route)

    def _pending(self, after: str | None) -> list[dict[str, Any]]:
        published = self.events[: self.published]
        if after is None:
            return published
        return [e for e in published if parse_cursor(e["id"]) > parse_cursor(after)]

    def _answer_stream(self, route: Route) -> None:
        events = self._pending(parse_qs(urlparse(route.request.url).query).get("after", [None])[0])
        self.ended = self.ended or any(e["event"] == "done" for e in events)
        route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            body=sse_frames(events),
        )

    def _stored_events(self, route: Route) -> None:
        route.fulfill(json=self.events[: self.published])


def recorded_run(chat: ChatPage, events: list[dict[str, Any]]) -> RecordedRun:
    """A real conversation whose run is the recorded one."""
    response = httpx.post(
        f"{chat.base_url}/api/conversations",
        json={"title": QUESTION},
        headers={"Authorization": f"Bearer {chat.api_key}"},
        timeout=10,
    )
    response.raise_for_status()
    return RecordedRun(chat.page, response.json()["id"], events)


def answer_html(chat: ChatPage) -> str:
    return chat.run_view(RUN_ID).locator("[data-testid=answer] .markdown").inner_html()


def assert_shows_run_resumed_once(chat: ChatPage) -> None:
    run = chat.run_view(RUN_ID)
    chat.wait_done("completed")
    assert chat.timeline(RUN_ID) == EXPECTED_TIMELINE
    lost = run.locator("[data-lost=true]")
    expect(lost).to_have_count(2)
    for card in lost.all():
        expect(card).to_have_class(re.compile(r"\blost-attempt\b"))
        expect(card.get_by_test_id("lost-label")).to_have_text("redone after resume")
    separator = run.get_by_test_id("resumed")
    expect(separator).to_have_attribute("data-attempt", "2")
    expect(separator).to_have_text("Resumed on another worker (attempt 2)")
    # done.answer is the deltas after the last resume, and that is what the page shows.
    assert answer_html(chat) == chat.markdown_html("".join(NEW_ANSWER))
    expect(run.get_by_test_id("answer")).not_to_contain_text("Stale")
    expect(run.locator(".answer-note")).to_have_count(0)
    expect(run.get_by_test_id("run-attempt")).to_be_hidden()
    expect(run.get_by_test_id("done-attempt")).to_have_text("finished on attempt 2")


def test_resumed_run_greys_out_the_lost_attempts_steps_and_restarts_the_answer(chat: ChatPage) -> None:
    fake = recorded_run(chat, RUN_RESUMED_ONCE)
    chat.open(fake.conversation_id)

    assert_shows_run_resumed_once(chat)
    assert fake.stream_cursors == [None]


def test_reload_after_a_resumed_run_ended_shows_it_the_same_way(chat: ChatPage) -> None:
    fake = recorded_run(chat, RUN_RESUMED_ONCE)
    chat.open(fake.conversation_id)
    chat.wait_done("completed")
    assert fake.ended

    chat.page.reload()
    expect(chat.page.locator("body")).to_have_attribute("data-ready", "yes")
    # The run is over: the page draws it from its stored events, not from the stream.
    assert_shows_run_resumed_once(chat)
    assert fake.stream_cursors == [None]


def test_run_being_resumed_says_so_and_survives_a_reload_mid_run(chat: ChatPage) -> None:
    fake = recorded_run(chat, RUN_RESUMED_ONCE)
    fake.publish_until(NEW_ATTEMPT_STARTED)
    chat.open(fake.conversation_id)
    run = chat.run_view(RUN_ID)

    def assert_mid_run() -> None:
        expect(run.get_by_test_id("run-attempt")).to_have_text("Resumed · attempt 2")
        expect(run.get_by_test_id("run-attempt")).to_be_visible()
        expect(run.get_by_test_id("resumed")).to_have_attribute("data-attempt", "2")
        expect(run.locator("[data-lost=true]")).to_have_count(2)
        # The first attempt's answer is dropped: the bubble is empty and waits for the new one.
        expect(run.get_by_test_id("answer")).to_have_text([""])
        expect(run.get_by_test_id("answer")).to_be_hidden()
        expect(run.get_by_test_id("thinking-card")).to_have_count(3)
        assert [(e["testid"], e["lost"]) for e in chat.timeline(RUN_ID)] == [
            ("separator-phase", False),
            ("thinking-card", False),
            ("tool-card", False),
            ("thinking-card", True),
            ("tool-card", True),
            ("answer", False),
            ("resumed", False),
            ("thinking-card", False),
        ]

    assert_mid_run()
    chat.page.reload()
    expect(chat.page.locator("body")).to_have_attribute("data-ready", "yes")
    assert_mid_run()
    # The reloaded page replayed its snapshot and streams on after the last event it had.
    expect(run.get_by_test_id("thinking-card")).to_have_count(3)
    assert fake.stream_cursors[-1] == RUN_RESUMED_ONCE[NEW_ATTEMPT_STARTED - 1]["id"], fake.stream_cursors

    fake.publish_the_rest()
    assert_shows_run_resumed_once(chat)


RUN_RESUMED_TWICE = [
    tool_start("1733150000000-0", 1, "calculator", {"expression": "17*23"}),
    tool_done("1733150000000-1", 1, "calculator", "391"),
    thinking("1733150000000-2", 2),
    thinking("1733150000000-3", 2, "Convert next."),
    ev("1733150000000-4", "answer", status="start"),
    delta("1733150000000-5", "first try"),
    resumed("1733150005000-0", 2, "1733150000000-1"),
    tool_start("1733150005000-1", 2, "unit_convert", {"value": 10}),
    tool_done("1733150005000-2", 2, "unit_convert", "6.21 mi"),
    ev("1733150005000-3", "answer", status="start"),
    delta("1733150005000-4", "second try"),
    # The second attempt never reached a checkpoint of its own: the third starts where it did.
    resumed("1733150010000-0", 3, "1733150000000-1"),
    tool_start("1733150010000-1", 2, "unit_convert", {"value": 10}),
    tool_done("1733150010000-2", 2, "unit_convert", "6.21 mi"),
    ev("1733150010000-3", "answer", status="start"),
    delta("1733150010000-4", "Third time: "),
    delta("1733150010000-5", "391 and 6.21 mi."),
    ev("1733150010000-6", "answer", status="done"),
    done("1733150010000-7", "Third time: 391 and 6.21 mi.", iterations=2),
]


def test_run_resumed_twice_keeps_only_the_answer_after_the_last_resume(chat: ChatPage) -> None:
    fake = recorded_run(chat, RUN_RESUMED_TWICE)
    chat.open(fake.conversation_id)
    chat.wait_done("completed")

    run = chat.run_view(RUN_ID)
    assert [(e["testid"], e["event"], e["lost"]) for e in chat.timeline(RUN_ID)] == [
        ("tool-card", "1733150000000-0", False),
        ("thinking-card", "1733150000000-2", True),
        ("resumed", "1733150005000-0", False),
        ("tool-card", "1733150005000-1", True),
        ("resumed", "1733150010000-0", False),
        ("tool-card", "1733150010000-1", False),
        ("answer", None, False),
        ("done-footer", None, False),
    ]
    expect(run.get_by_test_id("resumed")).to_have_text(
        ["Resumed on another worker (attempt 2)", "Resumed on another worker (attempt 3)"]
    )
    expect(run).to_have_attribute("data-attempt", "3")
    expect(run.get_by_test_id("answer").locator(".markdown")).to_have_text("Third time: 391 and 6.21 mi.")
    expect(run.locator(".answer-note")).to_have_count(0)
    expect(run.get_by_test_id("done-attempt")).to_have_text("finished on attempt 3")
    # The lost cards no longer look as if they were still running.
    expect(run.locator("[data-lost=true][data-state=running]")).to_have_count(0)


def test_new_attempts_reasoning_shows_even_when_the_lost_attempt_had_none_for_that_step(
    chat: ChatPage,
) -> None:
    events = [
        thinking("1733150000000-0", 1),
        thinking("1733150000000-1", 1, "Multiply first."),
        thinking("1733150000000-10", 2),
        thinking("1733150000000-11", 2, "   "),
        resumed("1733150009000-0", 2, "1733150000000-1"),
        thinking("1733150009000-1", 2),
        thinking("1733150009000-2", 2, "Convert the distance."),
        ev("1733150009000-3", "answer", status="delta", content="6.21 mi"),
        done("1733150009000-4", "6.21 mi", iterations=2),
    ]
    fake = recorded_run(chat, events)
    chat.open(fake.conversation_id)
    chat.wait_done("completed")

    cards = chat.run_view(RUN_ID).get_by_test_id("thinking-card")
    expect(cards).to_have_count(2)
    expect(cards.last).to_contain_text("Reasoning · step 2")
    expect(cards.last).to_contain_text("Convert the distance.")
    expect(cards.last).not_to_have_attribute("data-lost", "true")
