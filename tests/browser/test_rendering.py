"""The page's renderers in a real browser: model text never becomes markup, artifacts are sandboxed,
and the run view shows each event once and the fallback answer after a failed synthesis."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.chat_page import ChatPage

pytestmark = pytest.mark.slow

HOSTILE = """<script>window.pwned = 1</script>
<img src=x onerror="window.pwned = 2"> **bold** and `<b>code</b>`
[click](javascript:window.pwned=3) [fine](https://example.com/a_b?x=1&y=2)
| a | <i>b</i> |
|---|---|
| <svg onload="window.pwned=4"> | 2 |
"""


def render_into_page(chat: ChatPage, text: str) -> dict[str, Any]:
    result: dict[str, Any] = chat.page.evaluate(
        """async (text) => {
            const { renderMarkdown } = await import('/static/markdown.js');
            const box = document.createElement('div');
            box.innerHTML = renderMarkdown(text);
            document.body.append(box);
            return {
                text: box.textContent,
                tags: [...box.querySelectorAll('*')].map((n) => n.tagName.toLowerCase()),
                handlers: [...box.querySelectorAll('*')].flatMap((n) =>
                    [...n.attributes].map((a) => a.name).filter((name) => name.startsWith('on'))),
                hrefs: [...box.querySelectorAll('a')].map((a) => a.getAttribute('href')),
                pwned: window.pwned ?? null,
            };
        }""",
        text,
    )
    return result


def test_markdown_escapes_every_html_tag_of_model_text(chat: ChatPage) -> None:
    chat.open()
    out = render_into_page(chat, HOSTILE)

    assert not {"script", "img", "svg", "i", "b"} & set(out["tags"]), out["tags"]
    assert out["handlers"] == []
    assert out["pwned"] is None
    assert "<script>window.pwned = 1</script>" in out["text"]
    assert "<b>code</b>" in out["text"]
    assert {"strong", "code", "table", "a"} <= set(out["tags"])


def test_markdown_links_keep_only_web_urls(chat: ChatPage) -> None:
    chat.open()
    out = render_into_page(chat, HOSTILE)

    assert out["hrefs"] == ["https://example.com/a_b?x=1&y=2"]


def test_html_artifact_is_previewed_in_an_iframe_without_any_sandbox_rights(chat: ChatPage) -> None:
    chat.open()
    out = chat.page.evaluate(
        """async () => {
            const { renderArtifact } = await import('/static/run_view.js');
            const figure = renderArtifact({
                filename: 'report.html', mime_type: 'text/html',
                content: '<h1>Report</h1><script>parent.pwned = 5</script>',
            });
            const frame = figure.querySelector('iframe');
            const loaded = new Promise((resolve) => frame.addEventListener('load', resolve));
            document.body.append(figure);
            await loaded;
            return {
                sandbox: frame.getAttribute('sandbox'), srcdoc: frame.srcdoc, pwned: window.pwned ?? null,
            };
        }"""
    )

    assert out == {"sandbox": "", "srcdoc": "<h1>Report</h1><script>parent.pwned = 5</script>", "pwned": None}


def test_markdown_artifact_is_rendered_with_html_escaped(chat: ChatPage) -> None:
    chat.open()
    out = chat.page.evaluate(
        """async () => {
            const { renderArtifact } = await import('/static/run_view.js');
            const figure = renderArtifact({
                filename: 'notes.md', mime_type: 'text/markdown',
                content: '# Notes\\n<img src=x onerror=alert(1)>',
            });
            return { h1: figure.querySelector('h1')?.textContent, img: figure.querySelectorAll('img').length,
                     text: figure.textContent };
        }"""
    )

    assert out["h1"] == "Notes"
    assert out["img"] == 0
    assert "<img src=x onerror=alert(1)>" in out["text"]


def feed_run_view(chat: ChatPage, events: list[dict[str, Any]]) -> None:
    chat.page.evaluate(
        """async (events) => {
            const { RunView } = await import('/static/run_view.js');
            const view = new RunView({ runId: 'r1' });
            document.getElementById('messages').append(view.root);
            for (const ev of events) view.handle(ev);
        }""",
        events,
    )


def delta(event_id: str, content: str) -> dict[str, Any]:
    data = {"status": "delta", "content": content, "run_id": "r1"}
    return {"id": event_id, "event": "answer", "data": data}


def done(event_id: str, answer: str, error: str | None = None) -> dict[str, Any]:
    return {
        "id": event_id,
        "event": "done",
        "data": {
            "answer": answer,
            "iterations": 1,
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "llm_calls": 2},
            "elapsed": 1.5,
            "status": "completed",
            "error": error,
            "pending_injections": [],
            "run_id": "r1",
        },
    }


def test_event_delivered_twice_is_shown_once(chat: ChatPage) -> None:
    chat.open()
    tool = {
        "id": "3",
        "event": "step",
        "data": {
            "type": "iteration",
            "status": "start",
            "iteration": 1,
            "tool_name": "calculator",
            "tool_args": {"expression": "1+1"},
            "run_id": "r1",
        },
    }
    events = [tool, delta("4", "Two"), delta("5", " is the answer.")]
    feed_run_view(chat, [*events, *events, done("6", "Two is the answer.")])

    expect(chat.tool_cards()).to_have_count(1)
    expect(chat.answers()).to_have_text(["Two is the answer."])


def test_events_of_another_run_are_ignored(chat: ChatPage) -> None:
    chat.open()
    stray = delta("4", "not mine")
    stray["data"]["run_id"] = "r0"
    feed_run_view(chat, [stray, delta("5", "mine"), done("6", "mine")])

    expect(chat.answers()).to_have_text(["mine"])


def test_done_answer_replaces_partial_text_when_synthesis_failed(chat: ChatPage) -> None:
    chat.open()
    feed_run_view(chat, [delta("1", "The answ"), done("2", "Fallback: 4.", error="synthesis failed")])

    answer = chat.answers()
    expect(answer.locator(".markdown")).to_have_text("Fallback: 4.")
    expect(answer).not_to_contain_text("The answ")
    expect(chat.page.get_by_test_id("done-error")).to_have_text("synthesis failed")


def test_queued_follow_up_gives_way_to_the_inject_event(chat: ChatPage) -> None:
    chat.open()
    chat.page.evaluate(
        """async () => {
            const { RunView } = await import('/static/run_view.js');
            const view = new RunView({ runId: 'r1' });
            document.getElementById('messages').append(view.root);
            view.addQueuedFollowUp('and in euros?');
            window.testView = view;
        }"""
    )
    expect(chat.page.get_by_test_id("queued-followup")).to_have_text(
        "Follow-up · waiting for the agentand in euros?"
    )

    chat.page.evaluate(
        "window.testView.handle({id: '7', event: 'inject', data: {type: 'inject', content: 'and in euros?'}})"
    )
    expect(chat.page.get_by_test_id("queued-followup")).to_have_count(0)
    expect(chat.page.get_by_test_id("inject-bubble").locator(".bubble-text")).to_have_text(["and in euros?"])
