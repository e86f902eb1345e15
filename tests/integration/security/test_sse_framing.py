"""Text from users, tools and the model never breaks the SSE framing.

Every piece of text that reaches an event (the question, a follow-up, the model's tool arguments,
the tool's result, the streamed answer) carries SSE syntax: blank lines, ``data:``/``event:``/``id:``
/``retry:`` fields, comments, CR, CRLF, and the Unicode line separators that readers splitting like
``str.splitlines()`` (httpx's ``iter_lines``, the CLI) also take as line ends. Each event must still
arrive as one JSON ``data`` line (the strict reader of ``tests/support/sse.py`` fails on a second
one), carry the text unchanged, and be the same as ``GET /api/runs/{id}/events`` has it.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from app.tools.registry import Tool
from tests.integration.service.conftest import Api, ServiceFactory
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.sse import SseEvent, read_events

pytestmark = pytest.mark.timeout(60)

INJECTION = "\n\ndata: fake\n\nevent: done\n"
HOSTILE = (
    INJECTION
    + "\r\nid: 1-1\r\rretry: 1\n: a comment\n"
    + "\u2028data: separator\u2029event: done\x85id: 2-2\x0bdata: vt\x0cdata: ff\x1cend"
)
EVENT_NAMES = {"step", "answer", "compact", "phase", "inject", "done"}
FORGED_LINES = {"data: fake", "data: separator", "data: vt", "data: ff", "id: 1-1", "id: 2-2", "retry: 1"}


def echo_tool() -> Tool:
    async def echo(text: str) -> str:
        return f"echoed: {text}"

    return Tool(
        name="echo",
        description="Echo the text back.",
        parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        func=echo,
        timeout_s=5.0,
    )


def hostile_agent(hold_first_call: threading.Event) -> Any:
    """Calls ``echo`` with the hostile text, then answers with it; the first call waits for the gate."""
    agent = ToolAgentBehaviour(
        tool_name="echo",
        tool_args={"text": HOSTILE},
        tokens=["Answer: ", HOSTILE[:9], HOSTILE[9:40], HOSTILE[40:], " (end)"],
    )
    held = threading.Event()

    def handle(body: dict[str, Any]) -> FakeReply:
        reply = agent(body)
        if not held.is_set():
            held.set()
            return FakeReply.blocked(hold_first_call, reply)
        return reply

    return handle


def spec_lines(raw: bytes) -> list[str]:
    """The lines of an event stream as the SSE specification splits them: at CR, LF or CRLF only."""
    return re.split(r"\r\n|\r|\n", raw.decode())


def assert_well_framed(events: list[SseEvent], raw: bytes) -> None:
    names = [e.event for e in events]
    assert set(names) <= EVENT_NAMES, names
    assert names.count("done") == 1 and names[-1] == "done", names
    for event in events:
        assert json.loads(event.raw_data) == event.data
        assert event.id is not None and re.fullmatch(r"[0-9]+-[0-9]+", event.id), event.id
    for lines in (spec_lines(raw), raw.decode().splitlines()):
        assert not FORGED_LINES & set(lines), FORGED_LINES & set(lines)
        assert lines.count("event: done") == 1
        assert all(line.startswith(("id: ", "event: ", "data: ", ": ")) or line == "" for line in lines)


def payloads(events: list[SseEvent], event: str, **match: Any) -> list[dict[str, Any]]:
    return [e.data for e in events if e.event == event and all(e.data.get(k) == v for k, v in match.items())]


def read_stream(api: Api, conversation_id: str) -> tuple[list[SseEvent], bytes]:
    """The conversation's stream read twice from its start: by the strict reader, and as raw bytes."""
    path = f"/api/conversations/{conversation_id}/stream"
    with api.http.stream("GET", path) as response:
        assert response.status_code == 200
        events = read_events(response)
    with api.http.stream("GET", path) as response:
        raw = response.read()
    return events, raw


def test_hostile_text_of_user_follow_up_tool_and_model_arrives_whole_in_one_data_line(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    gate = threading.Event()
    fake_llm.set_handler(hostile_agent(gate))
    svc = service(llm=fake_llm)
    svc.add_tool(echo_tool())
    api = svc.api()
    conv = api.create_conversation()

    started = api.start_run(conv["id"], f"Echo this: {HOSTILE}")
    fake_llm.wait_for_requests(1)
    queued = api.http.post(f"/api/conversations/{conv['id']}/interrupt", json={"content": HOSTILE})
    gate.set()
    events, raw = read_stream(api, conv["id"])

    assert queued.status_code == 202
    assert_well_framed(events, raw)
    done = events[-1].data
    assert done["status"] == "completed", done
    assert payloads(events, "step", type="iteration", status="start")[0]["tool_args"] == {"text": HOSTILE}
    assert HOSTILE in payloads(events, "step", type="iteration", status="done")[0]["observation"]
    assert [p["content"] for p in payloads(events, "inject")] == [HOSTILE]
    deltas = "".join(p["content"] for p in payloads(events, "answer", status="delta"))
    assert deltas == done["answer"] and HOSTILE in deltas
    stored = api.run_events(started["run_id"])
    assert [(e["id"], e["event"], e["data"]) for e in stored] == [(e.id, e.event, e.data) for e in events]


def test_hostile_text_streamed_by_post_api_chat_is_framed_like_the_stream(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    released = threading.Event()
    released.set()
    fake_llm.set_handler(hostile_agent(released))
    svc = service(llm=fake_llm)
    svc.add_tool(echo_tool())
    api = svc.api()

    with api.http.stream("POST", "/api/chat", json={"message": HOSTILE}) as response:
        assert response.status_code == 200
        raw = response.read()
    events = read_events(httpx.Response(200, content=raw))  # the strict reader, over what came

    assert_well_framed(events, raw)
    assert events[-1].data["status"] == "completed"
    assert HOSTILE in events[-1].data["answer"]


def test_hostile_text_in_openai_compatible_chunks_stays_in_one_data_line(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    released = threading.Event()
    released.set()
    fake_llm.set_handler(hostile_agent(released))
    svc = service(llm=fake_llm)
    svc.add_tool(echo_tool())
    api = svc.api()
    body = {"model": "agentstream", "stream": True, "messages": [{"role": "user", "content": HOSTILE}]}

    with api.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        raw = response.read()

    for lines in (spec_lines(raw), raw.decode().splitlines()):
        assert not FORGED_LINES & set(lines)
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert all(line.startswith("data: ") or line == "" or line == ": ping" for line in lines)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    steps = [c["agentstream"]["step"] for c in chunks if "step" in c.get("agentstream", {})]
    assert HOSTILE in content
    assert any(s.get("tool_args") == {"text": HOSTILE} for s in steps)
    assert any(HOSTILE in (s.get("observation") or "") for s in steps)
