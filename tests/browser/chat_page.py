"""``ChatPage``: what the browser tests do with the page and read from it, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httpx
from playwright.sync_api import Locator, Page, expect

RUN_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class RunRecord:
    """A run as the service stored it: what the page should end up showing, once each."""

    events: list[dict[str, Any]]

    def count(self, event: str, **fields: Any) -> int:
        return sum(
            1
            for ev in self.events
            if ev["event"] == event and all(ev["data"].get(k) == v for k, v in fields.items())
        )

    @property
    def streamed_answer(self) -> str:
        return "".join(
            ev["data"]["content"]
            for ev in self.events
            if ev["event"] == "answer" and ev["data"].get("status") == "delta"
        )

    @property
    def reasoning_steps(self) -> int:
        """Thinking steps the page keeps a card for: those with reasoning, or never finished."""
        steps: dict[Any, str | None] = {}
        for ev in self.events:
            data = ev["data"]
            if data.get("type") == "thinking":
                steps[data["iteration"]] = data.get("reasoning") if data["status"] == "done" else None
        return sum(1 for reasoning in steps.values() if reasoning is None or reasoning.strip())

    @property
    def done(self) -> dict[str, Any]:
        return next(ev["data"] for ev in self.events if ev["event"] == "done")


class ChatPage:
    def __init__(self, page: Page, base_url: str, api_key: str | None = None) -> None:
        self.page = page
        self.base_url = base_url
        self.api_key = api_key

    # ---- doing -------------------------------------------------------------------------------

    def open(self, conversation_id: str | None = None) -> None:
        suffix = f"#/c/{conversation_id}" if conversation_id else ""
        self.page.goto(f"{self.base_url}/{suffix}")
        expect(self.page.locator("body")).to_have_attribute("data-ready", "yes")

    def send(self, text: str) -> str:
        """Start a run from the composer; returns its run id once the page is following it."""
        self.page.get_by_test_id("message-input").fill(text)
        self.page.get_by_test_id("send-button").click()
        run = self.page.locator("[data-testid=run][data-run-id]").last
        expect(self.page.get_by_test_id("interrupt-box")).to_be_visible()
        run_id = run.get_attribute("data-run-id")
        assert run_id
        return run_id

    def wait_done(self, status: str | None = None) -> Locator:
        footer = self.page.get_by_test_id("done-footer").last
        expect(footer).to_be_visible(timeout=RUN_TIMEOUT_MS)
        if status is not None:
            expect(footer).to_have_attribute("data-status", status)
        return footer

    # ---- reading -----------------------------------------------------------------------------

    @property
    def conversation_id(self) -> str:
        fragment = self.page.evaluate("location.hash")
        assert fragment.startswith("#/c/"), fragment
        return unquote(fragment.removeprefix("#/c/"))

    def tool_cards(self) -> Locator:
        return self.page.get_by_test_id("tool-card")

    def thinking_cards(self) -> Locator:
        return self.page.get_by_test_id("thinking-card")

    def answers(self) -> Locator:
        return self.page.get_by_test_id("answer")

    def run_view(self, run_id: str) -> Locator:
        return self.page.locator(f"[data-testid=run][data-run-id='{run_id}']")

    def timeline(self, run_id: str) -> list[dict[str, Any]]:
        """The run's timeline in order: each element's test id, the event that drew it (if any),
        whether it is marked as work of a lost attempt, and whether it is hidden."""
        entries: list[dict[str, Any]] = (
            self.run_view(run_id)
            .locator(".run-timeline > *")
            .evaluate_all(
                """(nodes) => nodes.map((node) => ({
                testid: node.dataset.testid ?? null,
                event: node.dataset.eventId ?? null,
                lost: node.dataset.lost === 'true',
                hidden: node.hidden,
            }))"""
            )
        )
        return entries

    def stored_run(self, run_id: str) -> RunRecord:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = httpx.get(f"{self.base_url}/api/runs/{run_id}/events", headers=headers, timeout=10)
        response.raise_for_status()
        return RunRecord(response.json())

    def markdown_html(self, text: str) -> str:
        """``text`` through the page's own renderer, serialised by the DOM as the bubble would be."""
        return str(
            self.page.evaluate(
                """async (text) => {
                    const { renderMarkdown } = await import('/static/markdown.js');
                    const box = document.createElement('div');
                    box.innerHTML = renderMarkdown(text);
                    return box.innerHTML;
                }""",
                text,
            )
        )

    def assert_shows_run_once(self, run_id: str) -> RunRecord:
        """Every step of the stored run is on screen exactly once, and the answer is the whole answer."""
        record = self.stored_run(run_id)
        run = self.page.locator(f"[data-testid=run][data-run-id='{run_id}']")
        expect(run).to_have_count(1)
        tool_calls = record.count("step", type="iteration", status="start")
        expect(run.get_by_test_id("tool-card")).to_have_count(tool_calls)
        expect(run.get_by_test_id("thinking-card")).to_have_count(record.reasoning_steps)
        expect(run.get_by_test_id("inject-bubble")).to_have_count(record.count("inject"))
        expect(run.get_by_test_id("done-footer")).to_have_count(1)
        # A cancelled run keeps what it had streamed; otherwise done.answer is what stays on screen.
        answer = record.done["answer"] or record.streamed_answer
        if answer:
            expect(run.get_by_test_id("answer")).to_have_count(1)
            bubble = run.locator("[data-testid=answer] .markdown")
            assert bubble.inner_html() == self.markdown_html(answer)
        else:
            expect(run.get_by_test_id("answer")).to_have_count(0)
        return record
