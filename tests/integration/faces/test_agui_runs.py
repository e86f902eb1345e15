"""The AG-UI face (FACES.md G-01..G-03): runs through ``POST /api/ag-ui``, on the real service with
the fake model over a socket, SQLite and the in-process bus; every response passes
``ag-ui-validate`` with no error and no warning (agui_support.AgUi.post).

A tool run streams its step, call, result and answer, and finishes with the run's own result and
usage; reasoning comes as reasoning messages; a follow-up posted through the own API shows as
``CUSTOM agentstream.inject``; a cancelled run ends as the client's protocol version says; bodies
that are not a ``RunAgentInput`` are 422 with nothing stored, unknown roles and parts are ignored.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.integration.faces.agui_support import (  # noqa: F401  (fixtures)
    AgUi,
    alice_fixture,
    in_background,
    play,
    run_input,
    service_fixture,
    thread_id,
    user,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(30)


def test_a_tool_run_streams_its_call_result_and_answer_and_finishes_with_the_runs_result_and_usage(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    body = run_input(thread_id(), [user("what is 6*7?", "u-1")])

    response = alice.post(body)

    assert response.status == 200
    started, finished = response.events[0], response.last
    assert started == {
        "type": "RUN_STARTED",
        "threadId": body["threadId"],
        "runId": body["runId"],
        "protocolVersion": "1.0",
        "timestamp": started["timestamp"],
    }
    assert finished["type"] == "RUN_FINISHED"
    assert (finished["threadId"], finished["runId"]) == (body["threadId"], body["runId"])
    run = alice.run(finished["result"]["run_id"])
    assert run["status"] == "completed"
    assert finished["result"] == {"run_id": run["run_id"], "answer": run["answer"], "usage": run["usage"]}
    assert finished["usage"] == [
        {
            "model": run["model"],
            "inputTokens": run["usage"]["prompt_tokens"],
            "outputTokens": run["usage"]["completion_tokens"],
            "totalTokens": run["usage"]["total_tokens"],
        }
    ]
    assert "outcome" not in finished  # a success: the protocol's default
    # A step per iteration (the second decides to answer), the answer in one of its own.
    steps = [(e["type"], e["stepName"]) for e in response.events if e["type"].startswith("STEP_")]
    assert steps == [
        ("STEP_STARTED", "iteration-1"),
        ("STEP_FINISHED", "iteration-1"),
        ("STEP_STARTED", "iteration-2"),
        ("STEP_FINISHED", "iteration-2"),
        ("STEP_STARTED", "answer"),
        ("STEP_FINISHED", "answer"),
    ]
    start = response.one("TOOL_CALL_START")
    call_id = start["toolCallId"]
    assert start["toolCallName"] == "calculator"
    assert json.loads(response.one("TOOL_CALL_ARGS")["delta"]) == {"expression": "6*7"}
    assert response.one("TOOL_CALL_END")["toolCallId"] == call_id
    result = response.one("TOOL_CALL_RESULT")
    assert result == {
        "type": "TOOL_CALL_RESULT",
        "messageId": f"tool_{call_id}",
        "toolCallId": call_id,
        "content": "6*7 = 42",
        "role": "tool",
        "timestamp": result["timestamp"],
    }
    assert response.text == agent.answer == run["answer"]
    text_id = response.one("TEXT_MESSAGE_START")["messageId"]
    # No snapshot before the end: the client holds the thread already, the run's messages built
    # from the events under the ids the thread has them by (test_agui_client: AG-UI's own client).
    assert "MESSAGES_SNAPSHOT" not in response.kinds
    assert alice.thread(body["threadId"]) == [
        {"id": "u-1", "role": "user", "content": "what is 6*7?"},
        {
            "id": start["parentMessageId"],
            "role": "assistant",
            "toolCalls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression":"6*7"}'},
                }
            ],
        },
        {"id": f"tool_{call_id}", "role": "tool", "content": "6*7 = 42", "toolCallId": call_id},
        {"id": text_id, "role": "assistant", "content": agent.answer},
    ]
    # The same run through the own API: the thread is a conversation holding the question.
    conversation = alice.only_conversation()
    assert conversation["messages"][0]["content"] == "what is 6*7?"
    assert conversation["messages"][-1]["content"] == agent.answer


def test_reasoning_comes_as_a_reasoning_message_per_iteration(alice: AgUi, gated_llm: FakeLLM) -> None:
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    body = run_input(thread_id(), [user("what is 6*7?")], forwardedProps={"agent": {"mode": "json"}})

    response = alice.post(body)

    contents = response.of("REASONING_MESSAGE_CONTENT")
    assert [e["delta"] for e in contents] == ["Use calculator.", "Nothing to look up."]
    first = contents[0]["messageId"]
    for kind in ("REASONING_START", "REASONING_MESSAGE_START", "REASONING_MESSAGE_END", "REASONING_END"):
        assert response.of(kind)[0]["messageId"] == first
    assert response.of("REASONING_MESSAGE_START")[0]["role"] == "reasoning"
    reasoning = [m for m in alice.thread(body["threadId"]) if m["role"] == "reasoning"]
    assert reasoning == [
        {"id": first, "role": "reasoning", "content": "Use calculator."},
        {"id": contents[1]["messageId"], "role": "reasoning", "content": "Nothing to look up."},
    ]
    assert response.last["type"] == "RUN_FINISHED"


def test_a_follow_up_posted_through_the_own_api_shows_as_a_custom_inject_event(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    agent = play(gated_llm, EchoAgentBehaviour())
    agent.close_gate()
    body = run_input(thread_id(), [user("first question")])
    pending = in_background(lambda: alice.post(body))
    conversation = alice.active_conversation()
    wait_until(lambda: agent.loop_calls >= 1, timeout=5, what="the engine to ask the model")

    posted = alice.http.post(
        f"/api/conversations/{conversation['id']}/interrupt", json={"content": "also say hello"}
    )
    assert posted.status_code == 202, posted.text
    agent.gate.set()
    response = pending.result(timeout=15)

    (inject,) = response.custom("agentstream.inject")
    assert inject["content"] == "also say hello" and inject["type"] == "inject"
    assert agent.saw("also say hello")
    # The client learns of the follow-up from the snapshot alone (CUSTOM events add no message).
    assert response.kinds[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert "also say hello" in [m["content"] for m in response.snapshot if m["role"] == "user"]
    assert response.snapshot == alice.thread(body["threadId"])


def test_a_tools_error_comes_with_the_snapshot_whose_tool_message_carries_it(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*"}))
    body = run_input(thread_id(), [user("what is 6*?")])

    response = alice.post(body)

    # TOOL_CALL_RESULT has no error of its own (it goes in its metadata): the client gets the
    # snapshot, whose tool message has it.
    result = response.one("TOOL_CALL_RESULT")
    error = result["metadata"]["agentstream"]["error"]
    assert "not a valid arithmetic expression" in error
    assert response.kinds[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    (tool,) = [m for m in response.snapshot if m["role"] == "tool"]
    assert tool["id"] == result["messageId"] and tool["error"] == error
    assert response.snapshot == alice.thread(body["threadId"])


def test_a_question_from_a_client_that_lacks_part_of_the_thread_ends_with_the_snapshot(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    thread = thread_id()
    first = alice.post(run_input(thread, [user("first question", "q-1")]))
    assert "MESSAGES_SNAPSHOT" not in first.kinds
    held = alice.thread(thread)

    in_step = alice.post(run_input(thread, [*held, user("second question", "q-2")]))
    stale = alice.post(run_input(thread, [*held[:1], user("third question", "q-3")]))  # lost an answer
    parts = alice.post(run_input(thread, [*alice.thread(thread), user(PARTS, "q-4")]))

    assert "MESSAGES_SNAPSHOT" not in in_step.kinds
    assert stale.kinds[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert [m["id"] for m in stale.snapshot if m["role"] == "user"] == ["q-1", "q-2", "q-3"]
    # A question of parts is stored as its text: the snapshot tells the client so.
    assert parts.kinds[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert parts.snapshot == alice.thread(thread)
    assert [m["content"] for m in parts.snapshot if m["id"] == "q-4"] == ["what is\nthe answer?"]


PARTS = [{"type": "text", "text": "what is"}, {"type": "text", "text": "the answer?"}]


@pytest.mark.parametrize("declares", [True, False], ids=["protocol-1.0", "no-protocol-version"])
def test_a_cancelled_run_finishes_cancelled_for_a_1_0_client_and_is_a_run_error_for_an_older_one(
    declares: bool, alice: AgUi, gated_llm: FakeLLM
) -> None:
    agent = play(gated_llm, EchoAgentBehaviour())
    agent.close_gate()
    body = run_input(thread_id(), [user("a question nobody waits for")])
    if not declares:
        del body["protocolVersion"]
    pending = in_background(lambda: alice.post(body))
    conversation = alice.active_conversation()

    cancelled = alice.http.post(f"/api/conversations/{conversation['id']}/cancel")
    assert cancelled.status_code == 202, cancelled.text
    response = pending.result(timeout=15)
    agent.gate.set()

    run = alice.run(conversation["active_run_id"])
    assert run["status"] == "cancelled"
    if declares:
        assert response.last["outcome"] == {"type": "cancelled"}
        assert "MESSAGES_SNAPSHOT" not in response.kinds  # nothing came that the client lacks
        (question,) = alice.thread(body["threadId"])
        assert question["id"] == body["messages"][0]["id"]
        assert "protocolVersion" in response.events[0]
    else:
        assert response.last["type"] == "RUN_ERROR"
        assert (response.last["code"], response.last["message"]) == ("cancelled", "cancelled")
        assert "protocolVersion" not in response.events[0]


BAD_BODIES: list[tuple[str, Any]] = [
    ("no threadId", {"runId": "r", "messages": []}),
    ("no runId", {"threadId": "t", "messages": []}),
    ("no messages", {"threadId": "t", "runId": "r"}),
    ("a threadId that is a number", {"threadId": 5, "runId": "r", "messages": []}),
    ("messages that are no list", {"threadId": "t", "runId": "r", "messages": {"id": "u"}}),
    ("a message that is no object", {"threadId": "t", "runId": "r", "messages": ["hello"]}),
    ("a message without a role", {"threadId": "t", "runId": "r", "messages": [{"id": "u", "content": "hi"}]}),
    (
        "a user message whose content is a number",
        {"threadId": "t", "runId": "r", "messages": [{"id": "u", "role": "user", "content": 5}]},
    ),
    (
        "a tool message without its call",
        {"threadId": "t", "runId": "r", "messages": [{"id": "m", "role": "tool", "content": "x"}]},
    ),
    (
        "a resume of an unknown status",
        {"threadId": "t", "runId": "r", "messages": [], "resume": [{"interruptId": "i", "status": "maybe"}]},
    ),
    ("a body that is a list", [{"threadId": "t", "runId": "r", "messages": []}]),
    # What the service cannot do with a well-formed body (FACES.md C-01, API.md's agent settings).
    ("a client tool named as a server tool", {"tools": [{"name": "calculator", "description": "x"}]}),
    (
        "a client tool whose parameters are no object schema",
        {"tools": [{"name": "t1", "description": "x", "parameters": {"type": "string"}}]},
    ),
    ("agent settings naming an unknown tool", {"forwardedProps": {"agent": {"tools": ["no_such_tool"]}}}),
    ("a question without text", {"messages": [{"id": "u", "role": "user", "content": "   "}]}),
]


@pytest.mark.parametrize(("case", "body"), BAD_BODIES, ids=[c for c, _ in BAD_BODIES])
def test_a_body_the_service_cannot_take_is_422_in_its_error_shape_and_stores_nothing(
    case: str, body: Any, alice: AgUi, gated_llm: FakeLLM
) -> None:
    if isinstance(body, dict) and "threadId" not in body and "runId" not in body:
        body = {**run_input(thread_id(), [user("what is 6*7?")]), **body}

    response = alice.post(body)

    assert response.status == 422, (case, response.status, response.body)
    error = json.loads(response.body)["error"]
    assert error["code"] == "invalid_request" and error["message"]
    assert alice.conversations() == []
    assert gated_llm.agent.requests == []


def test_unknown_roles_parts_and_fields_are_ignored_and_the_text_parts_are_the_question(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    question = {
        "id": "u-parts",
        "role": "user",
        "content": [
            {"type": "text", "text": "what is"},
            {"type": "binary", "mimeType": "image/png", "data": "AAAA"},
            {"type": "image", "source": {"type": "url", "value": "https://example.invalid/x.png"}},
            {"type": "text", "text": "the answer?"},
        ],
        "someFutureField": {"x": 1},
    }
    body = run_input(
        thread_id(),
        [
            {"id": "act-1", "role": "activity", "activityType": "progress", "content": {"pct": 50}},
            {"id": "x-1", "role": "hologram", "content": 3},
            question,
        ],
        newTopLevelField=True,
    )

    response = alice.post(body)

    assert response.last["type"] == "RUN_FINISHED"
    conversation = alice.only_conversation()
    assert next((m["role"], m["content"]) for m in conversation["messages"]) == (
        "user",
        "what is\nthe answer?",
    )
    assert alice.thread(body["threadId"])[0] == {
        "id": "u-parts",
        "role": "user",
        "content": "what is\nthe answer?",
    }


def test_the_face_takes_the_services_keys_like_every_route(service: ServerThread, gated_llm: FakeLLM) -> None:
    body = run_input(thread_id(), [user("what is 6*7?")])
    for headers in ({}, {"Authorization": "Bearer not-a-key"}):
        response = httpx.post(f"{service.base_url}/api/ag-ui", json=body, headers=headers, timeout=10)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "unauthorized"
    assert gated_llm.agent.requests == []


def test_a_failed_run_ends_with_a_run_error(alice: AgUi, gated_llm: FakeLLM) -> None:
    gated_llm.agent.inner = lambda body: FakeReply.error(503)  # type: ignore[assignment]

    response = alice.post(run_input(thread_id(), [user("what is 6*7?")]))

    error = response.last
    assert error["type"] == "RUN_ERROR" and error["code"] == "run_failed"
    run = alice.run(alice.only_conversation()["messages"][0]["run_id"])
    assert run["status"] == "failed" and error["message"] == run["error"]
    assert error["usage"][0]["totalTokens"] == run["usage"]["total_tokens"]
    assert "RUN_FINISHED" not in response.kinds
