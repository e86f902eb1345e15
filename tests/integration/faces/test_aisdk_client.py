"""The AI SDK face (FACES.md V-01..V-07) driven by the AI SDK's own chat client, in Node.

``tests/node/cases/aisdk_chat.mjs`` runs ``AbstractChat`` with ``DefaultChatTransport`` (the
``ai`` package pinned in tests/node) against a real service on the fake model: a tool run with
reasoning, approvals decided with ``addToolApprovalResponse``, a client tool through ``onToolCall``
+ ``addToolOutput``, ``regenerate()``, a resume after the POST's body is cut, a follow-up and a
stop through the own API and the face. In every case the message the client ends with is the one
``GET /api/ai-sdk/chat/{id}/messages`` gives, and the run record is the same as through the own API.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.service.test_client_tools import LOCATION, CallsBesideAgent
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    GatedAgent,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.node import require_node, run_node
from tests.support.server import CLIENT_TLS, ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

KEYS = "alice:key-alice,bob:key-bob"
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}


@pytest.fixture
def service(start_service: Callable[..., ServerThread]) -> ServerThread:
    require_node()
    return start_service(redis=False, api_keys=KEYS)


@pytest.fixture
def http(service: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.base_url, headers=ALICE, timeout=10, verify=CLIENT_TLS) as client:
        yield client


def chat_id() -> str:
    return f"chat-{secrets.token_hex(4)}"


def drive(service: ServerThread, scenario: str, chat: str, **env: Any) -> dict[str, Any]:
    variables = {
        "AGENTSTREAM_BASE": service.base_url,
        "AGENTSTREAM_KEY": "key-alice",
        "SCENARIO": scenario,
        "CHAT_ID": chat,
    }
    variables.update({k: json.dumps(v) if k == "AGENT" else str(v) for k, v in env.items()})
    result: dict[str, Any] = run_node("aisdk_chat.mjs", variables, timeout=50)
    return result


def in_background(fn: Callable[[], dict[str, Any]]) -> Future[dict[str, Any]]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def play(llm: FakeLLM, behaviour: EchoAgentBehaviour) -> GatedAgent:
    llm.agent.inner = behaviour
    return llm.agent


def assistant(result: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = result["messages"][-1]
    assert message["role"] == "assistant", result["messages"]
    return message


def same_as_server(result: dict[str, Any]) -> None:
    """V-07: the client's messages equal the service's view of the chat."""
    assert result["status"] == "ready", result
    assert result["messages"] == result["server"]


def tool_parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in message["parts"] if p["type"] == "dynamic-tool" or p["type"].startswith("tool-")]


def run_record(http: httpx.Client, run_id: str) -> dict[str, Any]:
    response = http.get(f"/api/runs/{run_id}")
    assert response.status_code == 200, response.text
    record: dict[str, Any] = response.json()
    return record


def test_a_tool_run_streams_reasoning_tool_and_text_parts_and_equals_the_service_view(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    chat = chat_id()

    result = drive(service, "send", chat, AGENT={"mode": "json", "tools": ["calculator"]})

    same_as_server(result)
    user, message = result["messages"]
    assert user["role"] == "user" and user["parts"] == [{"type": "text", "text": "what is 6*7?"}]
    run = run_record(http, message["id"])
    assert (run["status"], run["answer"]) == ("completed", agent.answer)
    kinds = [p["type"] for p in message["parts"]]
    # An iteration per step (the second decides to answer), and the answer in a step of its own.
    assert kinds == [
        "step-start",
        "reasoning",
        "dynamic-tool",
        "step-start",
        "reasoning",
        "step-start",
        "text",
    ], message["parts"]
    reasoning = message["parts"][1]
    assert (reasoning["text"], reasoning["state"]) == ("Use calculator.", "done")
    (tool,) = tool_parts(message)
    assert tool == {
        "type": "dynamic-tool",
        "toolName": "calculator",
        "toolCallId": tool["toolCallId"],
        "state": "output-available",
        "input": {"expression": "6*7"},
        "output": "6*7 = 42",
        "providerExecuted": True,
    }
    texts = [p for p in message["parts"] if p["type"] == "text"]
    assert texts == [{"type": "text", "text": agent.answer, "state": "done"}]
    # The same run as through the own API: its usage and model are the message's metadata.
    assert message["metadata"] == {
        "run_id": run["run_id"],
        "status": "completed",
        "usage": run["usage"],
        "model": run["model"],
    }
    conv = run["conversation_id"]
    stored = http.get(f"/api/conversations/{conv}").json()["messages"]
    assert stored[0]["role"] == "user" and stored[-1]["content"] == agent.answer


@pytest.mark.parametrize("approve", [True, False], ids=["approved", "denied"])
def test_an_approval_is_decided_with_add_tool_approval_response_and_the_same_message_goes_on(
    approve: bool, service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    chat = chat_id()

    result = drive(
        service,
        "approval",
        chat,
        AGENT={"tools": ["calculator"], "require_approval": ["calculator"]},
        APPROVE="true" if approve else "false",
        REASON="" if approve else "not today",
    )

    # First response: the call waits for the decision, and the message says so.
    asked = result["asked"][-1]
    (waiting,) = tool_parts(asked)
    assert waiting["type"] == "dynamic-tool" and waiting["state"] == "approval-requested"
    assert "providerExecuted" not in waiting  # else useChat would re-send in a loop (design note A1)
    assert asked["metadata"]["status"] == "waiting"
    same_as_server(result)
    message = assistant(result)
    assert message["id"] == asked["id"]  # the continuation is the same message
    assert len(result["messages"]) == 2
    (tool,) = tool_parts(message)
    run = run_record(http, message["id"])
    assert run["status"] == "completed" and message["metadata"]["status"] == "completed"
    approval_id = waiting["approval"]["id"]
    if approve:
        assert tool["state"] == "output-available" and tool["output"] == "6*7 = 42"
        assert tool["approval"] == {"id": approval_id, "approved": True}
    else:
        assert tool["state"] == "output-denied"
        assert tool["approval"] == {"id": approval_id, "approved": False, "reason": "not today"}
    assert [p for p in message["parts"] if p["type"] == "text"][-1]["text"] == agent.answer
    events = http.get(f"/api/runs/{run['run_id']}/events").json()
    decided = [e["data"] for e in events if e["event"] == "approval" and e["data"]["status"] != "requested"]
    assert [d["status"] for d in decided] == ["approved" if approve else "denied"]


def test_a_client_tool_runs_in_on_tool_call_and_its_output_carries_the_run_on(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("get_location", {"precision": "city"}))
    chat = chat_id()

    result = drive(service, "clientTool", chat, AGENT={"client_tools": [LOCATION]}, TEXT="where am I?")

    same_as_server(result)
    (call,) = result["calls"]
    assert (call["toolName"], call["input"]) == ("get_location", {"precision": "city"})
    assert "dynamic" not in call  # static: a docs-style onToolCall runs it
    message = assistant(result)
    (tool,) = tool_parts(message)
    output = {"city": "Paris", "asked": {"precision": "city"}}
    assert (tool["type"], tool["state"], tool["output"]) == ("tool-get_location", "output-available", output)
    assert [p for p in message["parts"] if p["type"] == "text"][-1]["text"] == agent.answer
    run = run_record(http, message["id"])
    observation = [
        e["data"]["observation"]
        for e in http.get(f"/api/runs/{run['run_id']}/events").json()
        if e["event"] == "step" and e["data"].get("status") == "done" and e["data"].get("client")
    ]
    assert json.loads(observation[0]) == output


def test_a_client_call_and_an_approval_of_one_reply_go_out_in_one_request_once_both_are_settled(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    play(gated_llm, CallsBesideAgent(("calculator", {"expression": "6*7"})))
    chat = chat_id()
    agent = {"tools": ["calculator"], "require_approval": ["calculator"], "client_tools": [LOCATION]}

    result = drive(service, "approval", chat, AGENT=agent, APPROVE="true", TEXT="where and what?")

    same_as_server(result)
    message = assistant(result)
    assert {p["state"] for p in tool_parts(message)} == {"output-available"}
    run = run_record(http, message["id"])
    assert run["status"] == "completed"
    # One continuation carried both: the model was asked again once, with both results.
    posts = [b for b in gated_llm.agent.requests if not b.get("stream")]
    assert sum(1 for b in posts if any(m.get("role") == "tool" for m in b["messages"])) == 1


def test_regenerate_answers_the_question_again_as_a_new_message_beside_the_first(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    chat = chat_id()

    result = drive(service, "regenerate", chat)

    same_as_server(result)
    first = result["first"][-1]
    user, second = result["messages"]
    assert second["id"] != first["id"] and user == result["first"][0]
    again = run_record(http, second["id"])
    assert again["status"] == "completed"
    conv = http.get(f"/api/conversations/{again['conversation_id']}").json()
    question, answer = conv["messages"]
    assert question["content"] == "what is 6*7?" and answer["run_id"] == second["id"]
    assert len(answer["sibling_ids"]) == 2  # the first answer is still there, beside it


def test_a_cut_stream_is_resumed_with_the_whole_message_and_nothing_doubled(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}, tokens=40, delay_s=0.03))
    chat = chat_id()

    result = drive(service, "resumeCut", chat, AGENT={"tools": ["calculator"]}, CUT_AFTER=8)

    assert result["cut"]["status"] == "error"  # the body broke off mid-stream
    assert result["resumes"] >= 1
    same_as_server(result)
    message = assistant(result)
    assert [p for p in message["parts"] if p["type"] == "text"] == [
        {"type": "text", "text": agent.answer, "state": "done"}
    ]
    assert len(tool_parts(message)) == 1 and len(result["messages"]) == 2


def test_a_follow_up_posted_through_the_own_api_shows_in_the_message_and_stop_cancels(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    agent = play(gated_llm, EchoAgentBehaviour())
    agent.close_gate()
    chat = chat_id()
    following = in_background(lambda: drive(service, "send", chat, TEXT="tell me about comets"))
    wait_until(lambda: agent.loop_calls >= 1, timeout=15, what="the run's first loop call")
    (conv,) = [
        c for c in http.get("/api/conversations").json()["items"] if c["title"] == "tell me about comets"
    ]
    posted = http.post(f"/api/conversations/{conv['id']}/interrupt", json={"content": "and asteroids"})
    assert posted.status_code == 202, posted.text
    agent.gate.set()

    result = following.result(timeout=45)

    same_as_server(result)
    message = assistant(result)
    injected = [p for p in message["parts"] if p["type"] == "data-agentstream-inject"]
    assert [p["data"]["content"] for p in injected] == ["and asteroids"]

    # Stop: POST .../stop cancels the active run; the message ends cancelled.
    agent.close_gate()
    stopped = in_background(lambda: drive(service, "reload", chat, TEXT="and planets?"))
    wait_until(lambda: agent.loop_calls >= 3, timeout=15, what="the second run's loop call")
    response = http.post(f"/api/ai-sdk/chat/{chat}/stop")
    assert response.status_code == 202, response.text
    agent.gate.set()
    result = stopped.result(timeout=45)
    message = assistant(result)
    assert message["metadata"]["status"] == "cancelled" and result["status"] == "ready"
    assert result["messages"] == result["server"]
    assert run_record(http, message["id"])["status"] == "cancelled"
    assert http.post(f"/api/ai-sdk/chat/{chat}/stop").status_code == 409


def test_a_chat_loaded_from_messages_is_asked_again_with_the_services_history(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    chat = chat_id()
    drive(service, "send", chat, AGENT={"tools": ["calculator"]})

    result = drive(service, "reload", chat, TEXT="and 7*8?")

    same_as_server(result)
    assert result["messages"][:2] == result["loaded"]
    assert [m["role"] for m in result["messages"]] == ["user", "assistant", "user", "assistant"]
    conv = http.get(f"/api/conversations/{run_record(http, result['messages'][1]['id'])['conversation_id']}")
    assert [m["role"] for m in conv.json()["messages"]].count("user") == 2  # nothing stored twice


def test_a_continuation_cut_after_an_approval_resumes_with_the_whole_message_of_both_responses(
    service: ServerThread, gated_llm: FakeLLM, http: httpx.Client
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}, tokens=40, delay_s=0.03))
    chat = chat_id()

    result = drive(
        service,
        "approvalCut",
        chat,
        AGENT={"tools": ["calculator"], "require_approval": ["calculator"]},
        CUT_AFTER=6,
    )

    assert result["cut"]["status"] == "error" and result["resumes"] >= 1
    same_as_server(result)
    message = assistant(result)
    # The resume replayed the message from its start: the call and its approval, asked in the
    # first response, are there, decided and run, and the answer once.
    (tool,) = tool_parts(message)
    assert (tool["state"], tool["approval"]["approved"], tool["output"]) == (
        "output-available",
        True,
        "6*7 = 42",
    )
    assert [p["text"] for p in message["parts"] if p["type"] == "text"] == [agent.answer]
    assert len(result["messages"]) == 2
