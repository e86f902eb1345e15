"""What a run does works on a branch that is not the conversation's first chain (FACES.md B-07),
through the real service: the fake model over a socket, SQLite with the in-process bus and
PostgreSQL with Redis, a real HTTP client.

Each test first asks two questions, then edits the second (a question below the first answer) or
answers it again (a new answer below it), and the run on that branch waits for an approval, takes
a follow-up, is cancelled, queues behind another conversation's run, or waits for a tool the
client runs. Besides the feature, each reads what the model was sent: every loop call of the
branch's run carries the path of the branch, and nothing of the first chain.

Self-contained on purpose (no helpers of test_branches.py or test_client_tools.py, which came with
branches): before branches (9333062) each test runs and fails where it makes its branch, as
messages had no id or parent_id then (the last one sooner: tools the client runs came with them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

import httpx
import pytest

from app.db.repositories import ConversationRepo, MessageRecord
from app.db.session import Database
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.test_approvals import approvals_of, decide, observation, wait_status
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
    thinking,
)
from tests.support.fake_agents import (
    EchoAgentBehaviour,
    _forced_function,
    _has_tool_result,
    _last_user_text,
)
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(40)

STACKS = pytest.mark.parametrize(
    ("database_backend", "redis_bus"),
    [
        pytest.param("sqlite", False, id="sqlite-memory"),
        pytest.param("postgres", True, id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)

FIRST, SECOND = "what is a comet?", "and an asteroid?"
"""The two questions of the first chain; each test's run goes on a branch beside SECOND."""

LOCATION = {
    "name": "get_location",
    "description": "Where the user is, as the browser knows it.",
    "parameters": {
        "type": "object",
        "properties": {"precision": {"type": "string", "enum": ["city", "street"]}},
        "required": ["precision"],
    },
}


class BranchAgent(EchoAgentBehaviour):
    """Answers each question with ``answer <n> to <question>`` (``answers`` keeps them in order), so
    every answer says which question it answers. Before any tool result, a question that says
    "calculate" asks for the calculator and one that says "where" for get_location."""

    CALLS: ClassVar[dict[str, tuple[str, dict[str, Any]]]] = {
        "calculate": ("calculator", {"expression": "6*7"}),
        "where": ("get_location", {"precision": "city"}),
    }

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        if not body.get("stream"):
            return super().__call__(body)
        # The synthesis call: its user message starts with "## Question\n<question>\n\n".
        prompt = str(body["messages"][-1]["content"])
        question = prompt.removeprefix("## Question\n").split("\n\n", 1)[0]
        with self._lock:
            answer = f"answer {len(self.answers) + 1} to {question}"
            self.answers.append(answer)
        return FakeReply.stream([answer[:7], answer[7:]])

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        asked = _last_user_text(body)
        for word, call in self.CALLS.items():
            if word in asked and not _has_tool_result(body):
                return FakeReply.tool_calls([call])
        return super().loop_reply(body)


@pytest.fixture
def agent(gated_llm: FakeLLM) -> GatedAgent:
    """The fake model's gate and request log, playing a ``BranchAgent`` (``agent.inner``)."""
    gated_llm.agent.inner = BranchAgent()
    return gated_llm.agent


# -- helpers -------------------------------------------------------------------------------------


def given_answers(agent: GatedAgent) -> list[str]:
    inner = agent.inner
    assert isinstance(inner, BranchAgent)
    with inner._lock:
        return list(inner.answers)


def post_run(api: Api, conv: str, **body: Any) -> httpx.Response:
    return api.http.post(f"/api/conversations/{conv}/runs", json=body)


def ask(api: Api, conv: str, **body: Any) -> str:
    response = post_run(api, conv, **body)
    assert response.status_code == 202, response.text
    return str(response.json()["run_id"])


def completed(api: Api, run_id: str) -> dict[str, Any]:
    run = api.wait_finished(run_id)
    assert run["status"] == "completed", run
    return run


def post_result(api: Api, conv: str, call_id: str, output: Any) -> httpx.Response:
    """The client's result of its tool's call ``call_id`` (FACES.md C-03)."""
    return api.http.post(f"/api/conversations/{conv}/tool-results/{call_id}", json={"output": output})


def branch(api: Api, conv: str) -> list[dict[str, Any]]:
    """The conversation's current branch, as ``GET /api/conversations/{id}`` has it."""
    response = api.http.get(f"/api/conversations/{conv}")
    assert response.status_code == 200, response.text
    return list(response.json()["messages"])


def first_chain(api: Api, agent: GatedAgent, conv: str) -> list[dict[str, Any]]:
    """Ask FIRST and SECOND, each answered; the conversation's branch then (four messages)."""
    runs = [completed(api, ask(api, conv, message=q))["run_id"] for q in (FIRST, SECOND)]
    chain = branch(api, conv)
    assert [(m["role"], m["content"], m["run_id"]) for m in chain] == [
        ("user", FIRST, runs[0]),
        ("assistant", f"answer 1 to {FIRST}", runs[0]),
        ("user", SECOND, runs[1]),
        ("assistant", f"answer 2 to {SECOND}", runs[1]),
    ]
    assert given_answers(agent) == [chain[1]["content"], chain[3]["content"]]
    return chain


def edit_second(api: Api, conv: str, chain: list[dict[str, Any]], message: str) -> str:
    """Edit SECOND into ``message``: a question below SECOND's parent (FACES.md B-02); its run."""
    assert chain[2]["content"] == SECOND
    return ask(api, conv, message=message, parent_id=chain[2]["parent_id"])


Said = tuple[str, str | None, tuple[str, ...], str | None]


def said(message: dict[str, Any]) -> Said:
    """A message as (role, content, its tool calls as "id name", the call it answers): the same for
    a message of the API and one the engine sent the model."""
    calls = tuple(f"{c['id']} {c['function']['name']}" for c in message.get("tool_calls") or ())
    return (message["role"], message.get("content"), calls, message.get("tool_call_id"))


def loop_calls(agent: GatedAgent, question: str) -> list[list[Said]]:
    """The messages of each loop call the model got with ``question`` among them, in order, the
    system prompt left out."""
    found = []
    for body in list(agent.requests):
        if body.get("stream") or _forced_function(body) is not None:
            continue
        messages = body["messages"]
        if any(m["role"] == "user" and m.get("content") == question for m in messages):
            assert messages[0]["role"] == "system", messages[0]
            found.append([said(m) for m in messages[1:]])
    return found


def requests_mentioning(agent: GatedAgent, text: str) -> list[int]:
    """The indexes of the requests the model got (loop and synthesis calls) with ``text`` in a message."""
    return [
        i
        for i, body in enumerate(list(agent.requests))
        if any(text in str(m.get("content")) for m in body.get("messages", ()))
    ]


def stored(database_url: str, conv: str) -> list[MessageRecord]:
    """Every message of the conversation in the database, of every branch."""

    async def read() -> list[MessageRecord]:
        db = Database(database_url)
        try:
            return await ConversationRepo(db.sessionmaker).messages(conv)
        finally:
            await db.dispose()

    return run_in_own_loop(read)


def switch(api: Api, conv: str, message_id: str) -> list[dict[str, Any]]:
    """PUT the conversation's head to the newest leaf below ``message_id``; its new branch."""
    response = api.http.put(f"/api/conversations/{conv}/head", json={"message_id": message_id})
    assert response.status_code == 200, response.text
    return list(response.json()["messages"])


def assert_on_the_branch(
    messages: list[dict[str, Any]], chain: list[dict[str, Any]], run_id: str
) -> dict[str, Any]:
    """``messages`` (a branch) are the chain's first two, then the edit's question and what its run
    ``run_id`` wrote, each below the one before; the question, a sibling of SECOND."""
    assert messages[:2] == chain[:2]
    question = messages[2]
    assert question["role"] == "user" and question["id"] not in {m["id"] for m in chain}
    assert (question["parent_id"], question["sibling_ids"]) == (
        chain[1]["id"],
        [chain[2]["id"], question["id"]],
    )
    assert [m["parent_id"] for m in messages[3:]] == [m["id"] for m in messages[2:-1]]
    assert {m["run_id"] for m in messages[2:]} == {run_id}
    return question


def old_chain_beside(chain: list[dict[str, Any]], question: dict[str, Any]) -> list[dict[str, Any]]:
    """The first chain as its branch reads once ``question`` is SECOND's sibling."""
    return [*chain[:2], {**chain[2], "sibling_ids": [chain[2]["id"], question["id"]]}, chain[3]]


# -- the tests -----------------------------------------------------------------------------------


@STACKS
def test_an_edit_whose_call_needs_approval_waits_on_its_branch_and_the_decision_completes_it_there(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation(require_approval=["calculator"])
    chain = first_chain(api, agent, conv)
    edit = "please calculate 6*7"

    run_id = edit_second(api, conv, chain, edit)

    waiting = wait_status(api, run_id, "waiting")
    (pending,) = waiting["pending_approvals"]
    assert (pending["tool_name"], pending["tool_args"], pending["status"]) == (
        "calculator",
        {"expression": "6*7"},
        "pending",
    )
    during = api.http.get(f"/api/conversations/{conv}").json()
    assert (during["active_run_id"], during["pending_approvals"]) == (run_id, [pending])
    (question,) = during["messages"][2:]
    assert question["content"] == edit
    assert assert_on_the_branch(during["messages"], chain, run_id) == question

    decided = decide(api, conv, pending["approval_id"], decision="approve")

    assert decided.status_code == 200, decided.text
    assert decided.json() == {"approval_id": pending["approval_id"], "status": "approved", "run_id": run_id}
    run = completed(api, run_id)
    now = branch(api, conv)
    assert assert_on_the_branch(now, chain, run_id) == question
    calling, result, answer = now[3:]
    assert said(calling) == ("assistant", None, ("call_0_calculator calculator",), None)
    assert said(result) == ("tool", "6*7 = 42", (), "call_0_calculator")
    assert (answer["role"], answer["content"]) == ("assistant", f"answer 3 to {edit}")
    assert run["answer"] == answer["content"] and run["pending_approvals"] == []
    events = api.wait_stored(run_id)
    assert [a["status"] for a in approvals_of(events)] == ["requested", "approved"]
    assert observation(events, "calculator") == "6*7 = 42"
    # Before and after the decision, the model was sent the edit's path and nothing else.
    path = [said(m) for m in chain[:2]]
    assert loop_calls(agent, edit) == [
        [*path, said(question)],
        [*path, said(question), said(calling), said(result)],
    ]
    assert requests_mentioning(agent, SECOND) == [2, 3]  # the second question's own run
    # The first chain is intact beside the edit, and the database holds the two branches alone.
    assert switch(api, conv, chain[2]["id"]) == old_chain_beside(chain, question)
    assert sorted(m.public_id for m in stored(migrated_database_url, conv)) == sorted(
        m["id"] for m in chain + now[2:]
    )


@STACKS
def test_a_follow_up_to_a_regenerate_held_by_the_model_is_folded_in_and_stored_on_its_branch(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    chain = first_chain(api, agent, conv)
    follow_up = "also give its speed"

    # SECOND answered again (FACES.md B-03): a new answer below the same question.
    agent.close_gate()
    run_id = ask(api, conv, regenerate=chain[3]["id"])
    with api.stream(conv) as stream:
        seen = stream.read(until=thinking)
        wait_until(lambda: len(loop_calls(agent, SECOND)) == 2, timeout=10, what="the run's loop call, held")

        posted = api.interrupt(conv, follow_up)

        assert posted.status_code == 202, posted.text
        assert posted.json() == {"queued": 1}
        agent.gate.set()
        seen += stream.read()

    assert [e.data["content"] for e in seen if e.event == "inject"] == [follow_up]
    assert (seen[-1].event, seen[-1].data["status"]) == ("done", "completed")
    assert as_stored(seen) == api.wait_stored(run_id)
    run = completed(api, run_id)
    # The model's next call, after the draft answer the follow-up came during, carried it below
    # the path to SECOND, as SECOND's first run had that path.
    path = [said(m) for m in chain[:3]]
    folded_in = ("user", f"[USER INTERRUPT] {follow_up}", (), None)
    assert loop_calls(agent, SECOND) == [
        path,
        path,
        [*path, ("assistant", f"Echo: {SECOND}", (), None), folded_in],
    ]
    assert requests_mentioning(agent, chain[3]["content"]) == []  # the first answer: nowhere
    # What the run stored hangs below SECOND, stored once: the follow-up, then the answer (the
    # draft it superseded is no message, as on any branch: LoopResult.messages).
    now = branch(api, conv)
    assert now[:3] == chain[:3]
    assert [said(m) for m in now[3:]] == [folded_in, ("assistant", f"answer 3 to {SECOND}", (), None)]
    assert [m["parent_id"] for m in now[3:]] == [chain[2]["id"], now[3]["id"]]
    assert [m["sibling_ids"] for m in now[3:]] == [[m["id"]] for m in now[3:]]
    assert {m["run_id"] for m in now[3:]} == {run_id}
    assert run["answer"] == now[-1]["content"] == given_answers(agent)[-1]
    # The first answer is intact below SECOND.
    assert switch(api, conv, chain[3]["id"]) == chain
    assert sorted(m.public_id for m in stored(migrated_database_url, conv)) == sorted(
        m["id"] for m in chain + now[3:]
    )


@STACKS
def test_a_cancelled_edit_leaves_its_question_as_the_current_leaf_and_the_next_question_goes_below_it(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    chain = first_chain(api, agent, conv)
    edit, later = "and a meteor?", "and a meteorite?"

    agent.close_gate()
    run_id = edit_second(api, conv, chain, edit)
    with api.stream(conv) as stream:
        seen = stream.read(until=thinking)
        wait_until(lambda: loop_calls(agent, edit), timeout=10, what="the edit's loop call, held")

        cancelled = api.cancel(conv)

        assert cancelled.status_code == 202, cancelled.text
        seen += stream.read()
    agent.gate.set()

    assert (seen[-1].event, seen[-1].data["status"]) == ("done", "cancelled")
    assert seen[-1].data["run_id"] == run_id
    assert api.wait_finished(run_id)["status"] == "cancelled"
    after = api.http.get(f"/api/conversations/{conv}").json()
    assert after["active_run_id"] is None
    (question,) = after["messages"][2:]  # the current leaf: the edit's question, unanswered
    assert said(question) == ("user", edit, (), None)
    assert assert_on_the_branch(after["messages"], chain, run_id) == question
    path = [*(said(m) for m in chain[:2]), said(question)]
    assert loop_calls(agent, edit) == [path]
    assert sorted(m.public_id for m in stored(migrated_database_url, conv)) == sorted(
        m["id"] for m in [*chain, question]
    )

    # Without parent_id, the next question goes below the current leaf: the cancelled question.
    next_run = completed(api, ask(api, conv, message=later))

    now = branch(api, conv)
    assert now[:3] == after["messages"]
    assert [(m["role"], m["content"], m["parent_id"], m["run_id"]) for m in now[3:]] == [
        ("user", later, question["id"], next_run["run_id"]),
        ("assistant", f"answer 3 to {later}", now[3]["id"], next_run["run_id"]),
    ]
    assert loop_calls(agent, later) == [[*path, ("user", later, (), None)]]
    assert requests_mentioning(agent, SECOND) == [2, 3]
    assert switch(api, conv, chain[2]["id"]) == old_chain_beside(chain, question)


@STACKS
def test_an_edit_queued_behind_another_conversations_run_starts_when_room_frees_with_its_path(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
) -> None:
    api = clients(start_service(redis=redis_bus, max_active_runs=1).base_url)
    conv, other = api.create_conversation(), api.create_conversation()
    chain = first_chain(api, agent, conv)
    edit, busy_question = "and a meteor?", "what keeps the worker busy?"
    agent.close_gate()
    busy = post_run(api, other, message=busy_question)
    assert (busy.status_code, busy.json()["status"]) == (202, "running"), busy.text
    wait_until(lambda: loop_calls(agent, busy_question), timeout=10, what="the other run at work")

    queued = post_run(api, conv, message=edit, parent_id=chain[2]["parent_id"])

    assert (queued.status_code, queued.json()["status"]) == (202, "queued"), queued.text
    run_id = queued.json()["run_id"]
    assert [e["data"] for e in api.events(run_id)] == [{"phase": "queued", "position": 1, "run_id": run_id}]
    during = api.http.get(f"/api/conversations/{conv}").json()
    assert during["active_run_id"] == run_id
    (question,) = during["messages"][2:]  # stored on its branch while it queues
    assert said(question) == ("user", edit, (), None)
    assert assert_on_the_branch(during["messages"], chain, run_id) == question
    assert loop_calls(agent, edit) == []

    agent.gate.set()

    assert completed(api, busy.json()["run_id"])["attempt"] == 1
    run = completed(api, run_id)
    assert run["attempt"] == 1
    phases = [e["data"]["phase"] for e in api.events(run_id) if e["event"] == "phase"]
    assert phases[0] == "queued" and "resumed" not in phases
    # It asked the model only once the other run was done with it, sending the edit's path.
    assert max(requests_mentioning(agent, busy_question)) < min(requests_mentioning(agent, edit))
    assert loop_calls(agent, edit) == [[*(said(m) for m in chain[:2]), said(question)]]
    assert requests_mentioning(agent, SECOND) == [2, 3]
    now = branch(api, conv)
    assert now[:3] == during["messages"]
    assert assert_on_the_branch(now, chain, run_id) == question
    assert [(m["role"], m["content"]) for m in now[3:]] == [("assistant", run["answer"])]
    assert run["answer"] == f"answer 4 to {edit}"  # the other run's answer was the third
    assert switch(api, conv, chain[2]["id"]) == old_chain_beside(chain, question)


@STACKS
def test_regenerate_while_an_edits_client_tool_call_waits_is_409_and_after_the_result_answers_again(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation(client_tools=[LOCATION])
    chain = first_chain(api, agent, conv)
    edit = "where am I?"
    run_id = edit_second(api, conv, chain, edit)
    (call,) = wait_status(api, run_id, "waiting")["pending_tool_calls"]
    assert (call["call_id"], call["tool_name"], call["tool_args"]) == (
        "call_0_get_location",
        "get_location",
        {"precision": "city"},
    )
    during = api.http.get(f"/api/conversations/{conv}").json()
    (question,) = during["messages"][2:]
    assert assert_on_the_branch(during["messages"], chain, run_id) == question

    refused = {
        name: post_run(api, conv, regenerate=target)
        for name, target in (
            ("the waiting question", question["id"]),
            ("the first chain's answer", chain[3]["id"]),
            ("the first question", chain[0]["id"]),
        )
    }

    assert {name: (r.status_code, r.json()["error"]["code"]) for name, r in refused.items()} == dict.fromkeys(
        refused, (409, "run_active")
    )
    assert api.http.get(f"/api/conversations/{conv}").json() == during
    answered = post_result(api, conv, call["call_id"], "Paris")
    assert answered.status_code == 200, answered.text
    assert answered.json() == {"call_id": call["call_id"], "status": "answered", "run_id": run_id}
    completed(api, run_id)
    first = branch(api, conv)
    assert assert_on_the_branch(first, chain, run_id) == question
    assert [said(m) for m in first[3:]] == [
        ("assistant", None, ("call_0_get_location get_location",), None),
        ("tool", "Paris", (), "call_0_get_location"),
        ("assistant", f"answer 3 to {edit}", (), None),
    ]

    # Now regenerate works: the edit's answer is answered again, below the same question.
    again = ask(api, conv, regenerate=first[-1]["id"])

    (second_call,) = wait_status(api, again, "waiting")["pending_tool_calls"]
    answered = post_result(api, conv, second_call["call_id"], "Lyon")
    assert answered.status_code == 200, answered.text
    assert answered.json()["run_id"] == again
    completed(api, again)
    second = branch(api, conv)
    assert second[:3] == [*chain[:2], question]
    calling = second[3]
    assert (calling["parent_id"], calling["sibling_ids"]) == (question["id"], [first[3]["id"], calling["id"]])
    assert [said(m) for m in second[3:]] == [
        ("assistant", None, ("call_0_get_location get_location",), None),
        ("tool", "Lyon", (), "call_0_get_location"),
        ("assistant", f"answer 4 to {edit}", (), None),
    ]
    assert [m["parent_id"] for m in second[4:]] == [m["id"] for m in second[3:-1]]
    assert {m["run_id"] for m in second[3:]} == {again}
    # Each of the two runs sent the model the edit's path, then its own call and result.
    path = [*(said(m) for m in chain[:2]), said(question)]
    assert loop_calls(agent, edit) == [
        path,
        [*path, said(first[3]), said(first[4])],
        path,
        [*path, said(second[3]), said(second[4])],
    ]
    assert requests_mentioning(agent, SECOND) == [2, 3]
    # The question is stored once.
    messages = stored(migrated_database_url, conv)
    assert [m.content for m in messages if m.role == "user"] == [FIRST, SECOND, edit]
    # The first answer is still there, beside the new one.
    assert switch(api, conv, first[3]["id"]) == [
        *first[:3],
        {**first[3], "sibling_ids": [first[3]["id"], calling["id"]]},
        *first[4:],
    ]
