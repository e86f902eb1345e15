"""A run that waits, through the AG-UI face (FACES.md G-04, C-01..C-03): the real service on the
fake model, every response checked by ``ag-ui-validate``.

An approval ends the response with a snapshot and an interrupt outcome; the next request's
``resume`` decides it (``cancelled`` is a denial) and the same run goes on in that response, which
starts with a snapshot. A resume that misses an open interrupt, names an unknown one or carries a
bad payload is ``RUN_ERROR invalid_resume`` and decides nothing. A client tool declared in
``tools`` ends the response with ``pendingToolCallIds``; the request carrying its ``tool`` message
streams the continuation, and the snapshots keep the client's id of that message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.api.faces.agui import resume as agui_resume
from app.api.faces.agui import routes as agui_routes
from app.api.faces.follow import is_waiting
from app.container import Services
from app.db.repositories import RunRecord
from app.streaming.bus import StoredEvent
from tests.integration.faces.agui_support import (  # noqa: F401  (fixtures)
    ALICE,
    AgUi,
    Response,
    alice_fixture,
    bob_fixture,
    play,
    run_input,
    service_fixture,
    thread_id,
    user,
)
from tests.integration.service.test_approvals import TwoToolsAgent
from tests.integration.service.test_client_tools import (
    ARGS,
    CALL_ID,
    LOCATION,
    CallsBesideAgent,
    tool_messages_sent,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread

pytestmark = pytest.mark.timeout(30)

APPROVING = {"agent": {"require_approval": ["calculator"]}}


def asked(alice: AgUi, llm: FakeLLM, **agent: Any) -> tuple[dict[str, Any], Response]:
    """A thread whose run waits for the approval of calculator(6*7): (its first input, response)."""
    play(llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    body = run_input(
        thread_id(), [user("what is 6*7?", "u-1")], forwardedProps={"agent": agent or APPROVING["agent"]}
    )
    return body, alice.post(body)


def resumed(
    body: dict[str, Any], first: Response, resume: list[dict[str, Any]], **more: Any
) -> dict[str, Any]:
    """The next input of the client: the thread it holds, the resume, a new ``runId``."""
    return run_input(body["threadId"], first.snapshot, resume=resume, **more)


def interrupt_id(first: Response) -> str:
    (interrupt,) = first.last["outcome"]["interrupts"]
    return str(interrupt["id"])


def test_an_approval_ends_the_response_with_an_interrupt_and_the_resume_carries_the_same_run_on(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    body, first = asked(alice, gated_llm)

    assert first.kinds[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    call = first.one("TOOL_CALL_START")
    assert first.of("TOOL_CALL_RESULT") == []
    run = alice.parked_run()
    (pending,) = run["pending_approvals"]
    (interrupt,) = first.last["outcome"]["interrupts"]
    assert first.last["outcome"]["type"] == "interrupt"
    assert interrupt == {
        "id": pending["approval_id"],
        "reason": "tool_call",
        "toolCallId": call["toolCallId"],
        "message": 'Allow calculator({"expression":"6*7"})?',
        "expiresAt": pending["expires_at"],
        "responseSchema": interrupt["responseSchema"],
        "metadata": {"tool_name": "calculator", "tool_args": {"expression": "6*7"}},
    }
    assert interrupt["responseSchema"]["required"] == ["approved"]
    # Nothing new while it waits: the same interrupt again; a new question meanwhile is refused.
    again = alice.post(run_input(body["threadId"], first.snapshot))
    assert again.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert again.last["outcome"] == first.last["outcome"] and again.snapshot == first.snapshot
    refused = alice.post(run_input(body["threadId"], [*first.snapshot, user("and 2+2?")]))
    assert refused.status == 409 and json.loads(refused.body)["error"]["code"] == "run_active"

    edited = {"approved": True, "editedArgs": {"expression": "2*3"}}
    second = alice.post(
        resumed(body, first, [{"interruptId": interrupt["id"], "status": "resolved", "payload": edited}])
    )

    assert second.kinds[:2] == ["RUN_STARTED", "MESSAGES_SNAPSHOT"]
    assert second.of("MESSAGES_SNAPSHOT")[0]["messages"] == first.snapshot
    (decision,) = second.custom("agentstream.approval")
    assert (decision["status"], decision["approval_id"], decision["tool_args"]) == (
        "approved",
        interrupt["id"],
        {"expression": "2*3"},
    )
    assert second.of("TOOL_CALL_START") == []  # the call is the snapshot's: no second start
    result = second.one("TOOL_CALL_RESULT")
    assert result["toolCallId"] == call["toolCallId"] and "2*3 = 6" in result["content"]
    finished = alice.run(run["run_id"])
    assert finished["status"] == "completed" and finished["pending_approvals"] == []
    assert second.last["result"] == {
        "run_id": run["run_id"],
        "answer": finished["answer"],
        "usage": finished["usage"],
    }
    assert second.text == finished["answer"]


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"status": "cancelled"}, None),
        ({"status": "resolved", "payload": {"approved": False, "reason": "not today"}}, "not today"),
    ],
    ids=["cancelled", "resolved-not-approved"],
)
def test_a_denial_through_resume_runs_nothing_and_the_model_reads_it(
    entry: dict[str, Any], reason: str | None, alice: AgUi, gated_llm: FakeLLM
) -> None:
    body, first = asked(alice, gated_llm)
    call_id = first.one("TOOL_CALL_START")["toolCallId"]

    second = alice.post(resumed(body, first, [{"interruptId": interrupt_id(first), **entry}]))

    (decision,) = second.custom("agentstream.approval")
    assert (decision["status"], decision["reason"]) == ("denied", reason)
    result = second.one("TOOL_CALL_RESULT")
    assert result["toolCallId"] == call_id and "42" not in result["content"]
    assert result["metadata"]["agentstream"]["error"] == result["content"]
    assert second.last["type"] == "RUN_FINISHED"
    run = alice.run(second.last["result"]["run_id"])
    assert run["status"] == "completed"
    denied = [m for m in second.snapshot if m["role"] == "tool"]
    assert denied == [
        {
            "id": f"tool_{call_id}",
            "role": "tool",
            "content": result["content"],
            "toolCallId": call_id,
            "error": result["content"],
        }
    ]


@pytest.mark.parametrize(
    "case",
    ["misses-an-open-interrupt", "unknown-id", "bad-payload", "edited-args-on-a-denial", "answered-twice"],
)
def test_a_resume_the_run_cannot_take_is_a_run_error_and_decides_nothing(
    case: str, alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, TwoToolsAgent())
    agent = {"require_approval": ["calculator", "word_count"]}
    body = run_input(thread_id(), [user("count and compute")], forwardedProps={"agent": agent})
    first = alice.post(body)
    one, two = (i["id"] for i in first.last["outcome"]["interrupts"])
    approve = {"status": "resolved", "payload": {"approved": True}}
    resume = {
        "misses-an-open-interrupt": [{"interruptId": one, **approve}],
        "unknown-id": [
            {"interruptId": one, **approve},
            {"interruptId": two, **approve},
            {"interruptId": "apr_" + "0" * 32, **approve},
        ],
        "bad-payload": [
            {"interruptId": one, **approve},
            {"interruptId": two, "status": "resolved", "payload": {"approved": "yes"}},
        ],
        "edited-args-on-a-denial": [
            {"interruptId": one, **approve},
            {
                "interruptId": two,
                "status": "resolved",
                "payload": {"approved": False, "editedArgs": {"text": "x"}},
            },
        ],
        "answered-twice": [
            {"interruptId": one, **approve},
            {"interruptId": two, **approve},
            {"interruptId": one, **approve},
        ],
    }[case]

    refused = alice.post(resumed(body, first, resume))

    assert refused.kinds == ["RUN_STARTED", "RUN_ERROR"]
    assert refused.last["code"] == "invalid_resume" and refused.last["message"]
    run = alice.parked_run()
    assert sorted(a["approval_id"] for a in run["pending_approvals"]) == sorted([one, two])


def test_another_owners_interrupt_is_unknown_to_a_thread_of_the_same_id(
    alice: AgUi, bob: AgUi, gated_llm: FakeLLM
) -> None:
    body, first = asked(alice, gated_llm)

    forged = bob.post(
        resumed(
            body,
            first,
            [{"interruptId": interrupt_id(first), "status": "resolved", "payload": {"approved": True}}],
        )
    )

    assert forged.kinds == ["RUN_STARTED", "RUN_ERROR"] and forged.last["code"] == "invalid_resume"
    assert bob.conversations() == []
    assert len(alice.parked_run()["pending_approvals"]) == 1


def test_a_cancelled_resume_of_an_interrupt_already_decided_is_a_no_op_and_the_question_runs(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    body, first = asked(alice, gated_llm)
    closed = interrupt_id(first)
    second = alice.post(
        resumed(body, first, [{"interruptId": closed, "status": "resolved", "payload": {"approved": True}}])
    )
    assert second.last["type"] == "RUN_FINISHED"

    # What the 1.0 client does for an interrupt it holds as expired: it cancels it beside its question.
    third = alice.post(
        run_input(
            body["threadId"],
            [*second.snapshot, user("thanks")],
            resume=[{"interruptId": closed, "status": "cancelled"}],
        )
    )

    assert third.last["type"] == "RUN_FINISHED" and "result" in third.last
    assert third.last["result"]["run_id"] != second.last["result"]["run_id"]
    decided = [
        e
        for e in alice.http.get(f"/api/runs/{second.last['result']['run_id']}/events").json()
        if e["event"] == "approval"
    ]
    assert [e["data"]["status"] for e in decided] == ["requested", "approved"]


def test_a_client_tool_ends_with_pending_tool_call_ids_and_its_tool_message_streams_the_continuation(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, CallsBesideAgent(("word_count", {"text": "one two three"})))
    body = run_input(thread_id(), [user("where am I?")], tools=[LOCATION])

    first = alice.post(body)

    starts = {e["toolCallName"]: e["toolCallId"] for e in first.of("TOOL_CALL_START")}
    assert set(starts) == {"word_count", "get_location"}
    location = starts["get_location"]
    # The server's call has its result; the client's has none (the client answers it).
    assert [e["toolCallId"] for e in first.of("TOOL_CALL_RESULT")] == [starts["word_count"]]
    assert first.kinds[-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert first.last["outcome"] == {"type": "success", "pendingToolCallIds": [location]}
    assert "result" not in first.last
    run = alice.run(alice.only_conversation()["active_run_id"])
    assert [c["call_id"] for c in run["pending_tool_calls"]] == [location]

    answer = {"id": "client-tool-msg-1", "role": "tool", "toolCallId": location, "content": "Paris"}
    second = alice.post(run_input(body["threadId"], [*first.snapshot, answer], tools=[LOCATION]))

    opening = second.of("MESSAGES_SNAPSHOT")[0]["messages"]
    assert second.kinds[:2] == ["RUN_STARTED", "MESSAGES_SNAPSHOT"]
    assert opening == [*first.snapshot, answer]  # the client's tool message kept, under its id
    assert second.of("TOOL_CALL_START") == [] and second.of("TOOL_CALL_RESULT") == []
    assert tool_messages_sent(gated_llm, location) == ["Paris"]
    assert second.last["type"] == "RUN_FINISHED" and second.last["result"]["run_id"] == run["run_id"]
    assert [m for m in second.snapshot if m["role"] == "tool"][-1] == answer
    assert alice.run(run["run_id"])["status"] == "completed"


def test_an_approval_and_a_client_call_parked_together_come_out_as_the_interrupt_first(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, CallsBesideAgent(("calculator", {"expression": "6*7"})))
    body = run_input(
        thread_id(), [user("compute, and where am I?")], tools=[LOCATION], forwardedProps=APPROVING
    )

    first = alice.post(body)

    assert first.last["outcome"]["type"] == "interrupt"  # the outcome cannot carry the call too
    starts = {e["toolCallName"]: e["toolCallId"] for e in first.of("TOOL_CALL_START")}
    assert set(starts) == {"calculator", "get_location"}
    approve = [{"interruptId": interrupt_id(first), "status": "resolved", "payload": {"approved": True}}]

    second = alice.post(resumed(body, first, approve, tools=[LOCATION]))

    # Decided; the run still waits for the client's tool, which this response names.
    assert second.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert second.last["outcome"] == {"type": "success", "pendingToolCallIds": [starts["get_location"]]}
    run = alice.run(alice.only_conversation()["active_run_id"])
    assert run["pending_approvals"] == [] and len(run["pending_tool_calls"]) == 1
    answer = {"id": "tm-1", "role": "tool", "toolCallId": starts["get_location"], "content": "Paris"}

    third = alice.post(run_input(body["threadId"], [*second.snapshot, answer], tools=[LOCATION]))

    assert [d["status"] for d in third.custom("agentstream.approval")] == ["approved"]
    result = third.one("TOOL_CALL_RESULT")
    assert (result["toolCallId"], result["content"]) == (starts["calculator"], "6*7 = 42")
    assert third.last["type"] == "RUN_FINISHED" and alice.run(run["run_id"])["status"] == "completed"


class LocatesEveryQuestion(EchoAgentBehaviour):
    """Calls get_location first in every run, then answers. The provider numbers a reply's calls
    from 0, so every run's call is ``call_0_get_location``: call ids are unique within a run only."""

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        messages = body.get("messages") or []
        if body.get("tools") and messages and messages[-1].get("role") == "user":
            return FakeReply.tool_calls([("get_location", ARGS)])
        return super().loop_reply(body)


def test_a_tool_message_of_an_earlier_run_is_no_result_for_a_new_call_of_the_same_id(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, LocatesEveryQuestion())
    thread = thread_id()
    first = alice.post(run_input(thread, [user("where am I?")], tools=[LOCATION]))
    assert first.last["outcome"] == {"type": "success", "pendingToolCallIds": [CALL_ID]}
    paris = {"id": "tm-paris", "role": "tool", "toolCallId": CALL_ID, "content": "Paris"}
    second = alice.post(run_input(thread, [*first.snapshot, paris], tools=[LOCATION]))
    assert second.last["type"] == "RUN_FINISHED" and "result" in second.last
    third = alice.post(run_input(thread, [*second.snapshot, user("and now?")], tools=[LOCATION]))
    assert third.last["outcome"] == {"type": "success", "pendingToolCallIds": [CALL_ID]}
    run = alice.parked_run()
    assert run["run_id"] != second.last["result"]["run_id"]
    asked_model = len(gated_llm.agent.requests)

    # The client sends its history again with no new tool message: run 1's "Paris" answers nothing.
    again = alice.post(run_input(thread, third.snapshot, tools=[LOCATION]))

    assert again.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert again.last["outcome"] == third.last["outcome"] and again.snapshot == third.snapshot
    parked = alice.parked_run()
    assert [c["call_id"] for c in parked["pending_tool_calls"]] == [CALL_ID]
    assert len(gated_llm.agent.requests) == asked_model  # the run did not go on

    lyon = {"id": "tm-lyon", "role": "tool", "toolCallId": CALL_ID, "content": "Lyon"}
    fourth = alice.post(run_input(thread, [*third.snapshot, lyon], tools=[LOCATION]))

    assert fourth.last["type"] == "RUN_FINISHED" and fourth.last["result"]["run_id"] == run["run_id"]
    loop = [b for b in gated_llm.agent.requests if not b.get("stream")][-1]
    sent = [m["content"] for m in loop["messages"] if m.get("role") == "tool"]
    assert sent == ["Paris", "Lyon"]  # run 1's result, then run 2's own
    assert [m for m in fourth.snapshot if m["role"] == "tool"] == [paris, lyon]


def test_a_tool_message_of_a_run_on_another_branch_is_no_result_for_a_new_call_of_the_same_id(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, LocatesEveryQuestion())
    thread = thread_id()
    agent = {"agent": {"client_tools": [LOCATION]}}
    first = alice.post(run_input(thread, [user("where am I?")], forwardedProps=agent))
    paris = {"id": "tm-paris", "role": "tool", "toolCallId": CALL_ID, "content": "Paris"}
    second = alice.post(run_input(thread, [*first.snapshot, paris]))
    assert second.last["type"] == "RUN_FINISHED" and "result" in second.last
    # The answer regenerated through the own API: its run calls call_0_get_location too, and parks.
    conversation = alice.only_conversation()
    question = next(m for m in conversation["messages"] if m["role"] == "user")
    regenerated = alice.http.post(
        f"/api/conversations/{conversation['id']}/runs", json={"regenerate": question["id"]}
    )
    assert regenerated.status_code == 202, regenerated.text
    run = alice.parked_run()
    assert [c["call_id"] for c in run["pending_tool_calls"]] == [CALL_ID]
    asked_model = len(gated_llm.agent.requests)

    # The client still holds the first branch, "Paris" and all: that result answers nothing now.
    again = alice.post(run_input(thread, second.snapshot))

    assert again.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert again.last["outcome"] == {"type": "success", "pendingToolCallIds": [CALL_ID]}
    assert [c["call_id"] for c in alice.parked_run()["pending_tool_calls"]] == [CALL_ID]
    assert len(gated_llm.agent.requests) == asked_model


@pytest.mark.parametrize("elsewhere", ["one", "both"])
def test_approvals_decided_through_the_own_api_while_a_resume_settles_them_count_as_settled(
    elsewhere: str, alice: AgUi, service: ServerThread, gated_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    play(gated_llm, TwoToolsAgent())
    agent = {"require_approval": ["calculator", "word_count"]}
    body = run_input(thread_id(), [user("count and compute")], forwardedProps={"agent": agent})
    first = alice.post(body)
    one, two = (i["id"] for i in first.last["outcome"]["interrupts"])
    conversation = alice.only_conversation()
    denied = [one] if elsewhere == "one" else [one, two]

    async def denied_first(*args: Any) -> None:
        """Someone denies ``denied`` through the own API after this request read them as pending,
        the moment before the request settles its plan."""
        async with httpx.AsyncClient(
            base_url=service.base_url, headers={"Authorization": f"Bearer {ALICE}"}
        ) as http:
            for approval_id in denied:
                decided = await http.post(
                    f"/api/conversations/{conversation['id']}/approvals/{approval_id}",
                    json={"decision": "deny", "reason": "decided elsewhere"},
                )
                assert decided.status_code == 200, decided.text
        await agui_resume.settle(*args)

    monkeypatch.setattr(agui_routes, "settle", denied_first)
    approve = {"status": "resolved", "payload": {"approved": True}}

    second = alice.post(
        resumed(body, first, [{"interruptId": one, **approve}, {"interruptId": two, **approve}])
    )

    if elsewhere == "both":  # nothing settled by this request: the first decisions stand
        assert second.status == 409 and json.loads(second.body)["error"]["code"] == "approval_closed"
        return
    assert second.status == 200, second.body
    decisions = {d["approval_id"]: (d["status"], d["reason"]) for d in second.custom("agentstream.approval")}
    assert decisions == {one: ("denied", "decided elsewhere"), two: ("approved", None)}  # the first stands
    assert second.last["type"] == "RUN_FINISHED"
    assert second.last["result"]["run_id"] == conversation["active_run_id"]
    assert alice.run(conversation["active_run_id"])["status"] == "completed"


def test_a_park_settled_in_the_moment_before_the_response_ends_is_followed_on(
    alice: AgUi, service: ServerThread, gated_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    follow_run = agui_routes.follow_run
    decided: list[str] = []

    async def approved_meanwhile(
        services: Services, run: RunRecord, after: str | None = None
    ) -> AsyncIterator[StoredEvent]:
        """The run's events until a ``waiting`` that still waits; then, the first time, someone
        approves what it waits for through the own API before the response reads it again."""
        last = None
        async for event in follow_run(services, run, after=after):
            last = event
            yield event
        if decided or last is None or not is_waiting(last):
            return
        (approval,) = await services.approvals.pending(run_ids=[run.id])
        async with httpx.AsyncClient(
            base_url=service.base_url, headers={"Authorization": f"Bearer {ALICE}"}
        ) as http:
            response = await http.post(
                f"/api/conversations/{run.conversation_id}/approvals/{approval.id}",
                json={"decision": "approve"},
            )
        assert response.status_code == 200, response.text
        decided.append(approval.id)

    monkeypatch.setattr(agui_routes, "follow_run", approved_meanwhile)

    _, first = asked(alice, gated_llm)

    assert len(decided) == 1
    assert [(d["status"], d["approval_id"]) for d in first.custom("agentstream.approval")] == [
        ("approved", decided[0])
    ]
    result = first.one("TOOL_CALL_RESULT")
    assert result["content"] == "6*7 = 42"
    assert first.last["type"] == "RUN_FINISHED" and "result" in first.last
    run = alice.run(first.last["result"]["run_id"])
    assert run["status"] == "completed" and first.text == run["answer"]
