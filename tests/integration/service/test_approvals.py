"""Tool calls that wait for a person (RUNS.md A-01..A-05), through the real service: the fake model
over a socket, SQLite, the in-process bus and Redis, a real HTTP client.

A call of a tool that needs approval becomes an ``approval`` event and a ``waiting`` run that no
worker holds; the owner's decision (approve, approve with edited arguments, deny with a reason)
carries it on; the first decision stands; an approval nobody decides expires; follow-ups and
cancel work while it waits; the /v1 face never waits for anyone.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from app.engine import prompts
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour, _has_tool_result
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(30)

BUSES = [pytest.param(False, id="memory"), pytest.param(True, id="redis", marks=pytest.mark.redis)]


class TwoToolsAgent(EchoAgentBehaviour):
    """Asks for ``calculator`` and ``word_count`` in one reply, then answers."""

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        if _has_tool_result(body) or not body.get("tools"):
            return super().loop_reply(body)
        return FakeReply.tool_calls(
            [("calculator", {"expression": "6*7"}), ("word_count", {"text": "one two three"})]
        )


def play(llm: FakeLLM, behaviour: EchoAgentBehaviour) -> None:
    llm.agent.inner = behaviour


def wait_status(api: Api, run_id: str, status: str, timeout: float = 15.0) -> dict[str, Any]:
    run: dict[str, Any] = wait_until(
        lambda: (r := api.run(run_id))["status"] == status and r,
        timeout=timeout,
        interval=0.05,
        what=f"run {run_id} to be {status}",
    )
    return run


def wait_done(api: Api, run_id: str) -> dict[str, Any]:
    run: dict[str, Any] = wait_until(
        lambda: (r := api.run(run_id))["status"] in ("completed", "failed", "cancelled") and r,
        timeout=15.0,
        interval=0.05,
        what=f"run {run_id} to end",
    )
    return run


def approvals_of(events: list[dict[str, Any]], status: str | None = None) -> list[dict[str, Any]]:
    found = [e["data"] for e in events if e["event"] == "approval"]
    return [d for d in found if status is None or d["status"] == status]


def observation(events: list[dict[str, Any]], tool: str) -> str:
    (done,) = [
        e["data"]
        for e in events
        if e["event"] == "step"
        and e["data"].get("type") == "iteration"
        and e["data"]["status"] == "done"
        and e["data"]["tool_name"] == tool
    ]
    return str(done["observation"])


def decide(api: Api, conv: str, approval_id: str, **body: Any) -> httpx.Response:
    return api.http.post(f"/api/conversations/{conv}/approvals/{approval_id}", json=body)


def waiting_run(
    api: Api, llm: FakeLLM, *, behaviour: EchoAgentBehaviour | None = None, **agent: Any
) -> tuple[str, str, dict[str, Any]]:
    """A run of a conversation whose calculator needs approval, waiting: (conv, run, its run record)."""
    play(llm, behaviour or ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    agent.setdefault("require_approval", ["calculator"])
    conv = api.create_conversation(**agent)
    run_id = api.start_run(conv, "what is 6*7?")
    return conv, run_id, wait_status(api, run_id, "waiting")


@pytest.mark.parametrize("redis_bus", BUSES)
def test_a_call_that_needs_approval_waits_and_the_owners_approval_carries_the_run_on(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)

    (pending,) = run["pending_approvals"]
    assert (pending["tool_name"], pending["tool_args"], pending["status"]) == (
        "calculator",
        {"expression": "6*7"},
        "pending",
    )
    requested = wait_until(
        lambda: approvals_of(api.events(run_id), "requested"), timeout=5, what="the request"
    )
    assert requested[0]["approval_id"] == pending["approval_id"]
    assert requested[0]["expires_at"] == pending["expires_at"]
    assert requested[0]["call_id"] == pending["call_id"] and requested[0]["iteration"] == 1
    assert api.http.get(f"/api/conversations/{conv}").json()["pending_approvals"] == [pending]
    assert api.http.get(f"/api/conversations/{conv}").json()["active_run_id"] == run_id
    inbox = api.http.get("/api/approvals", params={"status": "pending"}).json()["items"]
    assert [a["approval_id"] for a in inbox] == [pending["approval_id"]]
    assert not [e for e in api.events(run_id) if e["event"] == "done"]
    # A second run cannot start while this one waits: it is the conversation's active run.
    assert api.http.post(f"/api/conversations/{conv}/runs", json={"message": "x"}).status_code == 409

    response = decide(api, conv, pending["approval_id"], decision="approve")

    assert response.status_code == 200, response.text
    assert response.json() == {"approval_id": pending["approval_id"], "status": "approved", "run_id": run_id}
    finished = wait_done(api, run_id)
    assert finished["status"] == "completed" and finished["pending_approvals"] == []
    events = api.wait_stored(run_id)
    (approved,) = approvals_of(events, "approved")
    assert approved == {
        "status": "approved",
        "approval_id": pending["approval_id"],
        "reason": None,
        "tool_args": {"expression": "6*7"},
        "run_id": run_id,
    }
    assert observation(events, "calculator") == "6*7 = 42"
    assert not [e for e in events if e["event"] == "phase" and e["data"]["phase"] == "resumed"]
    # The run said that it waits, as the last event before the decision, naming what it waits for.
    (waiting,) = [e for e in events if e["event"] == "phase" and e["data"]["phase"] == "waiting"]
    assert waiting["data"] == {
        "phase": "waiting",
        "approval_ids": [pending["approval_id"]],
        "call_ids": [],
        "run_id": run_id,
    }
    after_wait = events[events.index(waiting) + 1]
    assert (after_wait["event"], after_wait["data"]["status"]) == ("approval", "approved")
    assert api.http.get("/api/approvals").json()["items"] == []


def test_an_approval_with_edited_arguments_runs_them_and_bad_ones_are_refused_leaving_it_pending(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)
    approval_id = run["pending_approvals"][0]["approval_id"]

    for bad in ({"expression": 5}, {}, {"expression": "1", "extra": True}):
        refused = decide(api, conv, approval_id, decision="approve", tool_args=bad)
        assert refused.status_code == 422, (bad, refused.text)
        assert refused.json()["error"]["code"] == "invalid_request"
    assert decide(api, conv, approval_id, decision="deny", tool_args={"expression": "1"}).status_code == 422
    assert decide(api, conv, approval_id, decision="maybe").status_code == 422
    assert api.run(run_id)["status"] == "waiting"
    assert api.run(run_id)["pending_approvals"][0]["status"] == "pending"

    assert (
        decide(api, conv, approval_id, decision="approve", tool_args={"expression": "2+2"}).status_code == 200
    )

    wait_done(api, run_id)
    events = api.wait_stored(run_id)
    assert approvals_of(events, "approved")[0]["tool_args"] == {"expression": "2+2"}
    assert observation(events, "calculator").endswith("4")
    started = [
        e["data"]
        for e in events
        if e["event"] == "step"
        and e["data"].get("status") == "start"
        and e["data"].get("type") == "iteration"
    ]
    assert [s["tool_args"] for s in started] == [{"expression": "2+2"}]
    # The model read which arguments ran.
    assert gated_llm.agent.saw("edited arguments")


def test_a_denial_with_a_reason_reaches_the_model_and_the_first_decision_stands(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)
    approval_id = run["pending_approvals"][0]["approval_id"]

    response = decide(api, conv, approval_id, decision="deny", reason="not today")

    assert response.status_code == 200 and response.json()["status"] == "denied"
    late = decide(api, conv, approval_id, decision="approve")
    assert late.status_code == 409 and late.json()["error"]["code"] == "approval_closed"
    assert decide(api, conv, "apr_" + "0" * 32, decision="approve").status_code == 404
    other = api.create_conversation()
    assert decide(api, other, approval_id, decision="approve").status_code == 404
    assert wait_done(api, run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    (denied,) = approvals_of(events, "denied")
    assert denied["reason"] == "not today"
    assert observation(events, "calculator") == prompts.denied_call("calculator", "not today")
    assert gated_llm.agent.saw("the user denied it")


def test_of_two_decisions_at_once_exactly_one_stands(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    first, second = start_service(redis=True), start_service(redis=True)
    api, other = clients(first.base_url), clients(second.base_url)
    conv, run_id, run = waiting_run(api, gated_llm)
    approval_id = run["pending_approvals"][0]["approval_id"]

    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(
            pool.map(
                lambda args: decide(args[0], conv, approval_id, decision=args[1]),
                [(api, "approve"), (other, "deny")],
            )
        )

    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 409], [r.text for r in answers]
    winner = next(r for r in answers if r.status_code == 200).json()["status"]
    assert wait_done(api, run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    assert [a["status"] for a in approvals_of(events) if a["status"] != "requested"] == [winner]


def test_an_approval_nobody_decides_expires_as_a_denial(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False, approval_timeout_s=0.5, run_lease_s=1.5).base_url)
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    conv = api.create_conversation(require_approval=["calculator"])
    run_id = api.start_run(conv, "what is 6*7?")

    assert wait_done(api, run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    (expired,) = approvals_of(events, "expired")
    assert expired["approval_id"] == approvals_of(events, "requested")[0]["approval_id"]
    assert observation(events, "calculator").startswith("The call of `calculator` was not executed")
    assert decide(api, conv, expired["approval_id"], decision="approve").status_code == 409


@pytest.mark.parametrize("redis_bus", BUSES)
def test_follow_ups_wait_with_the_run_and_cancel_ends_it_closing_its_approvals(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)
    approval_id = run["pending_approvals"][0]["approval_id"]

    assert api.interrupt(conv, "also, round it").status_code == 202
    assert api.cancel(conv).status_code == 202

    assert wait_done(api, run_id)["status"] == "cancelled"
    events = api.wait_stored(run_id)
    assert events[-1]["data"]["status"] == "cancelled"
    assert events[-1]["data"]["pending_injections"] == ["also, round it"]
    assert decide(api, conv, approval_id, decision="approve").status_code == 409
    assert api.http.get("/api/approvals").json()["items"] == []


def test_a_follow_up_posted_while_waiting_is_folded_in_when_the_run_goes_on(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=True).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)

    assert api.interrupt(conv, "and say hello").status_code == 202
    assert (
        decide(api, conv, run["pending_approvals"][0]["approval_id"], decision="approve").status_code == 200
    )

    assert wait_done(api, run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    assert [e["data"]["content"] for e in events if e["event"] == "inject"] == ["and say hello"]
    assert gated_llm.agent.saw("and say hello")


def test_the_calls_of_one_reply_that_need_no_approval_run_at_once_and_results_keep_call_order(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, run = waiting_run(api, gated_llm, behaviour=TwoToolsAgent())

    # word_count needed no approval: it ran while calculator waits.
    before = api.events(run_id)
    assert observation(before, "word_count").startswith("words: 3,")
    assert not [e for e in before if e["event"] == "step" and e["data"].get("tool_name") == "calculator"]
    assert [a["tool_name"] for a in run["pending_approvals"]] == ["calculator"]

    assert (
        decide(api, conv, run["pending_approvals"][0]["approval_id"], decision="approve").status_code == 200
    )

    assert wait_done(api, run_id)["status"] == "completed"
    # The tool messages follow the assistant message together, in call order.
    messages = api.http.get(f"/api/conversations/{conv}").json()["messages"]
    i = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    calls = [c["function"]["name"] for c in messages[i]["tool_calls"]]
    assert calls == ["calculator", "word_count"]
    follow = messages[i + 1 : i + 3]
    assert [m["role"] for m in follow] == ["tool", "tool"]
    assert [m["tool_call_id"] for m in follow] == [c["id"] for c in messages[i]["tool_calls"]]
    assert follow[0]["content"] == "6*7 = 42"


def test_the_service_list_applies_unless_the_conversation_says_otherwise(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False, require_approval="*").base_url)
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))

    asked = api.start_run(api.create_conversation(), "what is 6*7?")
    free = api.start_run(api.create_conversation(require_approval=[]), "what is 6*7?")

    assert wait_status(api, asked, "waiting")["pending_approvals"][0]["tool_name"] == "calculator"
    assert wait_done(api, free)["status"] == "completed"
    assert observation(api.wait_stored(free), "calculator") == "6*7 = 42"
    bad = api.http.post("/api/conversations", json={"agent": {"require_approval": ["no_such_tool"]}})
    assert bad.status_code == 422


def test_the_openai_face_never_waits_for_a_person(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False, require_approval="calculator").base_url)
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))

    response = api.http.post(
        "/v1/chat/completions",
        json={"model": "agentstream", "messages": [{"role": "user", "content": "what is 6*7?"}]},
    )

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert gated_llm.agent.saw(prompts.approval_unavailable("calculator")[:40])
    assert api.http.get("/api/approvals").json()["items"] == []


def test_metrics_count_approvals(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)

    waiting = api.http.get("/metrics").text
    assert "agentstream_approvals_requested_total 1.0" in waiting
    assert "agentstream_approvals_pending 1.0" in waiting
    decide(api, conv, run["pending_approvals"][0]["approval_id"], decision="deny")
    wait_done(api, run_id)

    after = api.http.get("/metrics").text
    assert 'agentstream_approvals_decided_total{outcome="denied"} 1.0' in after
    assert "agentstream_approvals_pending 0.0" in after


def test_bad_ids_and_arguments_are_refused_without_a_500_and_change_nothing(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, run = waiting_run(api, gated_llm)
    approval_id = run["pending_approvals"][0]["approval_id"]

    for bad_id in ("%00", "apr_" + "g" * 32, "x" * 300, approval_id.upper()):
        assert decide(api, conv, bad_id, decision="approve").status_code == 404, bad_id
    deep: Any = "x"
    for _ in range(300):
        deep = {"a": deep}
    assert decide(api, conv, approval_id, decision="approve", tool_args=deep).status_code in (400, 422)
    huge = {"expression": "1+" * 40_000 + "1"}
    assert decide(api, conv, approval_id, decision="approve", tool_args=huge).status_code == 422
    assert decide(api, conv, approval_id, decision="approve", reason="x" * 2001).status_code == 422
    assert decide(api, conv, approval_id, decision="approve", extra=1).status_code == 422

    assert api.run(run_id)["status"] == "waiting"
    assert api.run(run_id)["pending_approvals"][0]["status"] == "pending"
    assert decide(api, conv, approval_id, decision="deny").status_code == 200


def test_only_the_conversations_owner_decides_and_every_decision_is_audited(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_service(redis=False, api_keys="alice:key-alice,bob:key-bob")
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    with (
        httpx.Client(base_url=server.base_url, headers={"Authorization": "Bearer key-alice"}) as alice,
        httpx.Client(base_url=server.base_url, headers={"Authorization": "Bearer key-bob"}) as bob,
    ):
        conv = alice.post("/api/conversations", json={"agent": {"require_approval": ["calculator"]}}).json()[
            "id"
        ]
        run_id = alice.post(f"/api/conversations/{conv}/runs", json={"message": "6*7?"}).json()["run_id"]
        run = wait_until(
            lambda: (r := alice.get(f"/api/runs/{run_id}").json())["status"] == "waiting" and r,
            timeout=15,
            what="the run to wait",
        )
        approval_id = run["pending_approvals"][0]["approval_id"]
        path = f"/api/conversations/{conv}/approvals/{approval_id}"

        assert bob.post(path, json={"decision": "approve"}).status_code == 404
        assert bob.get("/api/approvals").json()["items"] == []
        assert alice.get("/api/approvals").json()["items"][0]["approval_id"] == approval_id
        with caplog.at_level("INFO", logger="app.audit"):
            edited = {"decision": "approve", "tool_args": {"expression": "7*6"}}
            assert alice.post(path, json=edited).status_code == 200

    (record,) = [r for r in caplog.records if r.name == "app.audit" and r.getMessage() == "approval decided"]
    assert record.decided_by == "alice" and record.decision == "approved"  # type: ignore[attr-defined]
    assert record.args_before == {"expression": "6*7"}  # type: ignore[attr-defined]
    assert record.args_after == {"expression": "7*6"}  # type: ignore[attr-defined]
    assert record.decided_at and record.approval_id == approval_id  # type: ignore[attr-defined]
