"""``/api/tools`` and the conversation routes: create, list with pages, read, delete."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.service.conftest import Api, LogRecorder, ServiceFactory
from tests.support.fake_agents import EchoAgentBehaviour, is_json_protocol_call
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.server import wait_until


def test_tools_lists_every_builtin_tool_with_name_description_and_json_schema(alice: Api) -> None:
    response = alice.http.get("/api/tools")

    assert response.status_code == 200
    tools = response.json()
    assert {t["name"] for t in tools} >= {"calculator", "current_time", "unit_convert", "word_count"}
    for tool in tools:
        assert set(tool) == {"name", "description", "parameters"}
        assert tool["description"]
        assert tool["parameters"]["type"] == "object"
    calculator = next(t for t in tools if t["name"] == "calculator")
    assert "expression" in calculator["parameters"]["properties"]


def test_create_without_a_body_then_read_it_back(stack_api: Api) -> None:
    api = stack_api

    created = api.create_conversation()
    detail = api.conversation(created["id"])

    assert set(created) == {"id", "title", "agent", "created_at", "updated_at"}
    assert isinstance(created["id"], str) and created["id"]
    assert created["title"]
    assert created["agent"] == {}
    assert detail == {
        **created,
        "messages": [],
        "active_run_id": None,
        "pending_approvals": [],
        "pending_tool_calls": [],
    }


def test_create_with_title_and_agent_spec_keeps_both(alice: Api) -> None:
    api = alice
    agent = {
        "mode": "json",
        "tools": ["calculator", "word_count"],
        "max_iterations": 5,
        "completion_check": False,
        "system_prompt": "Be brief.\nUse tools.",
    }

    created = api.create_conversation({"title": "Sums", "agent": agent})

    assert created["title"] == "Sums"
    assert created["agent"] == agent
    assert api.conversation(created["id"])["agent"] == agent


def test_create_with_an_empty_json_object_is_like_no_body(alice: Api) -> None:
    api = alice

    created = api.create_conversation({})

    assert created["agent"] == {}


@pytest.mark.parametrize(
    ("agent", "mentions"),
    [
        ({"tools": ["calculator", "no_such_tool"]}, "no_such_tool"),
        ({"mode": "turbo"}, "mode"),
        ({"max_iterations": 0}, "max_iterations"),
        ({"completion_check": "sometimes"}, "completion_check"),
        ({"temperature": 2}, "temperature"),
    ],
    ids=["unknown-tool", "bad-mode", "zero-iterations", "bad-bool", "unknown-field"],
)
def test_an_invalid_agent_spec_is_422_and_creates_nothing(
    alice: Api, agent: dict[str, object], mentions: str
) -> None:
    api = alice
    before = api.snapshot()

    response = api.http.post("/api/conversations", json={"title": "x", "agent": agent})

    assert response.status_code == 422
    error = response.json()["error"]
    assert set(error) == {"code", "message"}
    assert mentions in error["message"]
    assert api.snapshot() == before


def test_list_is_newest_first_in_pages_until_next_cursor_is_null(stack_api: Api) -> None:
    api = stack_api
    ids = [api.create_conversation({"title": f"c{i}"})["id"] for i in range(5)]

    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        response = api.http.get("/api/conversations", params=params)
        assert response.status_code == 200
        body = response.json()
        assert set(body) == {"items", "next_cursor"}
        assert len(body["items"]) <= 2
        seen += [c["id"] for c in body["items"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break

    assert seen == list(reversed(ids))
    assert pages == 3


def test_a_full_last_page_has_a_null_next_cursor(alice: Api) -> None:
    api = alice
    for i in range(2):
        api.create_conversation({"title": f"c{i}"})

    body = api.http.get("/api/conversations", params={"limit": "2"}).json()

    assert len(body["items"]) == 2
    assert body["next_cursor"] is None


@pytest.mark.parametrize(
    "cursor",
    ["not-a-cursor", "eyJhIjoxfQ", "W10", "WyJ4IiwieSJd", "%%%", "WzEsMl0", "WyIyMDI0LTAxLTAxIiwiYyJd"],
    ids=["garbage", "object", "empty-list", "bad-date", "symbols", "numbers", "naive-date"],
)
def test_an_invalid_list_cursor_is_4xx(alice: Api, cursor: str) -> None:
    alice.create_conversation()

    response = alice.http.get("/api/conversations", params={"cursor": cursor})

    assert 400 <= response.status_code < 500
    assert set(response.json()["error"]) == {"code", "message"}


@pytest.mark.parametrize("limit", ["0", "-1", "101", "ten", "1.5"])
def test_an_invalid_list_limit_is_422(alice: Api, limit: str) -> None:
    response = alice.http.get("/api/conversations", params={"limit": limit})

    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"


def test_a_conversation_read_back_has_the_runs_messages_and_no_active_run(alice: Api) -> None:
    api = alice
    conv = api.create_conversation()
    outcome = api.run(conv["id"], "What is 6*7?")

    detail = api.conversation(conv["id"])

    assert detail["active_run_id"] is None
    roles = [m["role"] for m in detail["messages"]]
    assert roles[0] == "user" and roles[-1] == "assistant"
    assert "tool" in roles
    assert detail["messages"][0]["content"] == "What is 6*7?"
    assert detail["messages"][-1]["content"] == outcome.done["answer"]
    assert {m["run_id"] for m in detail["messages"]} == {outcome.run_id}
    calls = [m for m in detail["messages"] if m["tool_calls"]]
    assert calls and calls[0]["tool_calls"][0]["function"]["name"] == "calculator"


def test_active_run_id_names_the_running_run(service: ServiceFactory, fake_llm: FakeOpenAIServer) -> None:
    release = threading.Event()
    fake_llm.script(FakeReply.blocked(release, FakeReply.text("done")))
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    started = api.start_run(conv["id"], "hello")
    fake_llm.wait_for_requests(1)

    during = api.conversation(conv["id"])
    release.set()
    api.stream(conv["id"])
    after = api.conversation(conv["id"])

    assert during["active_run_id"] == started["run_id"]
    assert after["active_run_id"] is None


def test_unknown_conversation_is_404_on_read_and_delete(alice: Api) -> None:
    api = alice

    for response in (
        api.http.get("/api/conversations/conv_missing"),
        api.http.delete("/api/conversations/conv_missing"),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_delete_is_204_then_the_conversation_its_runs_and_events_are_gone(stack_api: Api) -> None:
    api = stack_api
    keep = api.create_conversation({"title": "keep"})
    conv = api.create_conversation({"title": "drop"})
    outcome = api.run(conv["id"], "What is 2+2?")

    deleted = api.http.delete(f"/api/conversations/{conv['id']}")

    assert deleted.status_code == 204
    assert deleted.content == b""
    assert api.http.get(f"/api/conversations/{conv['id']}").status_code == 404
    assert api.http.get(f"/api/runs/{outcome.run_id}").status_code == 404
    assert api.http.get(f"/api/runs/{outcome.run_id}/events").status_code == 404
    assert api.http.get(f"/api/conversations/{conv['id']}/stream").status_code == 404
    assert api.http.delete(f"/api/conversations/{conv['id']}").status_code == 404
    assert [c["id"] for c in api.http.get("/api/conversations").json()["items"]] == [keep["id"]]


def test_delete_cancels_the_active_run_first(service: ServiceFactory, fake_llm: FakeOpenAIServer) -> None:
    release = threading.Event()
    fake_llm.script(FakeReply.blocked(release, FakeReply.text("never seen")))
    svc = service(llm=fake_llm)
    api = svc.api()
    conv = api.create_conversation()
    api.start_run(conv["id"], "hello")
    fake_llm.wait_for_requests(1)

    try:
        deleted = api.http.delete(f"/api/conversations/{conv['id']}")
    finally:
        release.set()

    assert deleted.status_code == 204
    assert api.http.get(f"/api/conversations/{conv['id']}").status_code == 404
    wait_until(lambda: svc.services.manager.active_count == 0, what="the run task to end")
    assert len(fake_llm.requests) == 1  # the run stopped at the blocked call


def test_a_delete_racing_a_run_start_is_204_and_the_start_202_or_404_never_500(
    service: ServiceFactory, app_logs: LogRecorder
) -> None:
    svc = service(log_level="INFO")
    api = svc.api()

    def start(conversation_id: str) -> int:
        with httpx.Client(base_url=svc.base_url, timeout=15) as http:
            url = f"/api/conversations/{conversation_id}/runs"
            return http.post(url, json={"message": "What is 1+1?"}).status_code

    def delete(conversation_id: str) -> int:
        with httpx.Client(base_url=svc.base_url, timeout=15) as http:
            return http.delete(f"/api/conversations/{conversation_id}").status_code

    outcomes = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for _ in range(6):
            conv = api.create_conversation()
            started, deleted = pool.submit(start, conv["id"]), pool.submit(delete, conv["id"])
            outcomes.append((started.result(), deleted.result()))

    assert all(s in (202, 404) and d == 204 for s, d in outcomes), outcomes
    # Runs that started in a conversation deleted under them end without retrying their writes.
    wait_until(lambda: svc.services.manager.active_count == 0, timeout=10, what="every run task to end")
    assert not [line for line in app_logs.lines if "retrying" in line or "unhandled" in line]
    assert api.http.get("/api/conversations").json()["items"] == []


def test_the_conversations_agent_spec_shapes_what_the_model_is_sent(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm).api()
    native = api.create_conversation(
        {"agent": {"tools": ["calculator", "word_count"], "system_prompt": "Answer like a pirate."}}
    )
    json_mode = api.create_conversation({"agent": {"mode": "json"}})

    api.run(native["id"], "What is 2+2?")
    native_call = fake_llm.requests[-2]
    api.run(json_mode["id"], "What is 3+3?")
    json_call = fake_llm.requests[-2]

    assert not native_call.get("stream") and not json_call.get("stream")
    assert {t["function"]["name"] for t in native_call["tools"]} == {"calculator", "word_count"}
    assert any("Answer like a pirate." in str(m["content"]) for m in native_call["messages"])
    assert not json_call.get("tools")
    assert is_json_protocol_call(json_call)


def test_max_iterations_of_the_agent_spec_bounds_the_run(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    echo = EchoAgentBehaviour()

    def always_a_tool(body: dict[str, Any]) -> FakeReply:
        if body.get("stream") or not body.get("tools"):
            return echo(body)
        return FakeReply.tool_calls([("calculator", {"expression": f"{len(body['messages'])}*2"})])

    fake_llm.set_handler(always_a_tool)
    api = service(llm=fake_llm).api()
    conv = api.create_conversation({"agent": {"max_iterations": 2, "completion_check": False}})

    outcome = api.run(conv["id"], "Keep calculating.")

    assert outcome.done["status"] == "completed"
    assert outcome.done["iterations"] == 2
    tool_steps = [e for e in outcome.events if e.event == "step" and e.data["type"] == "iteration"]
    assert len([e for e in tool_steps if e.data["status"] == "done"]) == 2


def test_an_empty_tool_list_means_an_agent_without_tools(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm).api()
    conv = api.create_conversation({"agent": {"tools": []}})

    outcome = api.run(conv["id"], "Just talk to me.")

    assert outcome.done["status"] == "completed"
    assert conv["agent"]["tools"] == []
    loop_calls = [b for b in fake_llm.requests if not b.get("stream")]
    assert loop_calls and all(not b.get("tools") for b in loop_calls)


def test_the_demo_model_answers_an_agent_without_tools(alice: Api) -> None:
    conv = alice.create_conversation({"agent": {"tools": []}})

    outcome = alice.run(conv["id"], "What is 6*7?")

    assert outcome.done["status"] == "completed"
    assert outcome.done["answer"]
    assert not [e for e in outcome.events if e.event == "step" and e.data["type"] == "iteration"]
