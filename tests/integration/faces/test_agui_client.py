"""The AG-UI face driven by AG-UI's own client (FACES.md G-05): ``HttpAgent`` of ``@ag-ui/client``
1.0.0 in Node (tests/node/cases/agui_agent.mjs) against the real service on the fake model.

Its verifier and schema enforcement must report nothing (no failed run, no ``[ag-ui]`` warning: a
warning means a field or event the protocol does not know reached it), and what the agent ends
with must be the thread as the service has it: a tool run; an approval approved and one denied
through ``agent.pendingInterrupts`` and ``runAgent({resume})``; a frontend tool declared in
``runAgent({tools})``, whose tool message the app adds before it runs the agent again; and a
CopilotKit-like second run, a new agent per request given the history the browser holds.

A response that streams a whole run to a client that held the thread ends without a
``MESSAGES_SNAPSHOT``: the agent builds the run's messages from the events, and they must be the
thread's. Where the events cannot tell it all (a tool's error, a history that is not the thread's)
the snapshot comes, and the agent ends with the thread all the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.faces.agui_support import ALICE, KEYS, AgUi, play, run_input, thread_id
from tests.integration.service.test_client_tools import CallsBesideAgent, tool_messages_sent
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.node import require_node, run_node
from tests.support.server import ServerThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(name="service")
def service_fixture(start_service: Callable[..., ServerThread]) -> ServerThread:
    require_node()
    return start_service(redis=False, api_keys=KEYS)


def drive(service: ServerThread, scenario: str, thread: str, **env: Any) -> dict[str, Any]:
    variables = {
        "AGENTSTREAM_BASE": service.base_url,
        "AGENTSTREAM_KEY": ALICE,
        "SCENARIO": scenario,
        "THREAD_ID": thread,
    }
    variables.update({k: json.dumps(v) if k == "AGENT" else str(v) for k, v in env.items()})
    result: dict[str, Any] = run_node("agui_agent.mjs", variables, timeout=50)
    return result


def clean(result: dict[str, Any]) -> None:
    """Nothing the client had to say: no failed run, no RUN_ERROR, no '[ag-ui]' warning."""
    assert result["warnings"] == []
    for run in result["runs"]:
        assert run["failures"] == [] and run["runErrors"] == [], run
        assert not [line for line in run["consoleErrors"] if "Agent execution failed" in line]


def same_as_service(service: ServerThread, thread: str, messages: list[dict[str, Any]]) -> None:
    """The agent's messages are the thread as the service has it (its snapshot, asked now)."""
    caller = AgUi(service.base_url, ALICE)
    try:
        now = caller.post(run_input(thread, messages))
    finally:
        caller.close()
    assert now.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert messages == now.snapshot


def kinds_of(run: dict[str, Any]) -> list[str]:
    return [e["type"] for e in run["events"]]


def test_a_tool_run_through_http_agent(service: ServerThread, gated_llm: FakeLLM) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    thread = thread_id()

    result = drive(service, "tool", thread, AGENT={"mode": "json"})

    clean(result)
    (run,) = result["runs"]
    assert run["outcome"] == "success" and run["result"]["answer"] == agent.answer
    kinds = [e["type"] for e in run["events"]]
    assert kinds[0] == "RUN_STARTED" and kinds[-1] == "RUN_FINISHED"
    assert {
        "REASONING_MESSAGE_CONTENT",
        "TOOL_CALL_START",
        "TOOL_CALL_RESULT",
        "TEXT_MESSAGE_CONTENT",
    } <= set(kinds)
    assert run["pendingToolCallIds"] == []  # every call of the server has its result
    assert "MESSAGES_SNAPSHOT" not in kinds  # the agent holds the thread from the events alone
    roles = [m["role"] for m in result["messages"]]
    assert roles == ["user", "reasoning", "assistant", "tool", "reasoning", "assistant"]
    assert result["messages"][-1]["content"] == agent.answer
    same_as_service(service, thread, result["messages"])


@pytest.mark.parametrize("approve", [True, False], ids=["approved", "denied"])
def test_an_approval_through_pending_interrupts_and_resume(
    approve: bool, service: ServerThread, gated_llm: FakeLLM
) -> None:
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    thread = thread_id()

    result = drive(
        service, "approval", thread, AGENT={"require_approval": ["calculator"]}, APPROVE=str(approve).lower()
    )

    clean(result)
    asked, decided = result["runs"]
    assert asked["outcome"] == "interrupt"
    (interrupt,) = asked["interrupts"]
    assert interrupt["reason"] == "tool_call" and interrupt["toolCallId"]
    assert decided["outcome"] == "success" and decided["pendingAfter"] == []
    (decision,) = [e["value"] for e in decided["events"] if e["type"] == "CUSTOM"]
    assert decision["status"] == ("approved" if approve else "denied")
    (tool,) = [m for m in result["messages"] if m["role"] == "tool"]
    assert tool["toolCallId"] == interrupt["toolCallId"]
    assert ("6*7 = 42" in tool["content"]) is approve
    assert result["messages"][-1]["content"] == decided["result"]["answer"]
    same_as_service(service, thread, result["messages"])


def test_a_frontend_tool_declared_in_run_agent_is_answered_by_the_apps_tool_message(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    play(gated_llm, CallsBesideAgent(("word_count", {"text": "one two three"})))
    thread = thread_id()

    result = drive(service, "frontend-tool", thread, TEXT="where am I?")

    clean(result)
    first, second = result["runs"]
    (pending,) = first["pendingToolCallIds"]
    assert first["outcome"] == "success" and first["result"] is None
    assert second["outcome"] == "success" and second["pendingToolCallIds"] == []
    assert tool_messages_sent(gated_llm, pending) == ["Paris, France"]
    answered = [m for m in result["messages"] if m["role"] == "tool" and m["toolCallId"] == pending]
    assert (
        len(answered) == 1
        and answered[0]["id"].startswith("tool-")
        and answered[0]["content"] == "Paris, France"
    )
    assert result["messages"][-1]["content"] == second["result"]["answer"]
    same_as_service(service, thread, result["messages"])


def test_a_second_run_given_the_browsers_history_stores_only_the_new_question(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    thread = thread_id()

    result = drive(service, "second-run", thread, TEXT="first question")

    clean(result)
    first, second = result["runs"]
    assert first["result"]["run_id"] != second["result"]["run_id"]
    assert [k for r in result["runs"] for k in kinds_of(r) if k == "MESSAGES_SNAPSHOT"] == []
    users = [m["content"] for m in result["messages"] if m["role"] == "user"]
    assert users == ["first question", "and now?"]
    caller = AgUi(service.base_url, ALICE)
    try:
        stored = caller.only_conversation()["messages"]
    finally:
        caller.close()
    assert [m["content"] for m in stored if m["role"] == "user"] == ["first question", "and now?"]
    same_as_service(service, thread, result["messages"])


def test_a_tools_error_comes_with_the_snapshot_and_the_agent_holds_it_as_the_thread_does(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*"}))
    thread = thread_id()

    result = drive(service, "tool", thread)

    clean(result)
    (run,) = result["runs"]
    assert kinds_of(run)[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    (tool,) = [m for m in result["messages"] if m["role"] == "tool"]
    assert "not a valid arithmetic expression" in tool["error"]
    same_as_service(service, thread, result["messages"])


def test_a_browser_whose_history_is_not_the_threads_gets_the_thread_at_the_end(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    thread = thread_id()

    result = drive(service, "stale-history", thread, TEXT="first question")

    clean(result)
    first, second = result["runs"]
    assert "MESSAGES_SNAPSHOT" not in kinds_of(first)
    assert kinds_of(second)[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    # Every message of the thread, the first question's from the snapshot; in the agent's order (a
    # snapshot leaves the messages the agent holds where they are and adds the others after them).
    caller = AgUi(service.base_url, ALICE)
    try:
        now = caller.thread(thread)
    finally:
        caller.close()
    assert {m["id"]: m for m in result["messages"]} == {m["id"]: m for m in now}
    users = [m["content"] for m in result["messages"] if m["role"] == "user"]
    assert sorted(users) == ["and now?", "first question"]
