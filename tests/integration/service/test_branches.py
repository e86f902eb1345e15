"""Conversations as trees through the real service (FACES.md B-01..B-05, B-07): the fake model over a
socket, SQLite and PostgreSQL, a real HTTP client; and a run on a branch whose worker is killed
with SIGKILL, carried on by another worker process on its branch.

The fake model answers every question with a text of its own ("answer <n> to <question>"), so each
assistant message says which question it answers; what the engine sent it for each loop call is
kept, so a test reads a run's history as the model got it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.db.repositories import ConversationRepo, MessageRecord
from app.db.session import Database
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    GatedAgent,
    clients_fixture,
    fake_llm_serving,
    gated_llm_fixture,
    new_redis_prefix,
    redis_keys,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import ToolAgentBehaviour, _forced_function, _last_user_text
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

KEYS = "alice:key-alice,bob:key-bob"


class BranchAgent(ToolAgentBehaviour):
    """Answers each question with ``answer <n> to <question>`` (``n`` counts the answers given,
    which ``answers`` keeps in order); a question that says "calculate" first asks for the
    calculator."""

    def __init__(self) -> None:
        super().__init__("calculator", {"expression": "6*7"})
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
        if "calculate" in _last_user_text(body):
            return super().loop_reply(body)
        return super(ToolAgentBehaviour, self).loop_reply(body)


@pytest.fixture
def agent(gated_llm: FakeLLM) -> GatedAgent:
    """The fake model's gate and request log; it plays a ``BranchAgent`` (``agent.inner``)."""
    gated_llm.agent.inner = BranchAgent()
    return gated_llm.agent


def answers(agent: GatedAgent) -> list[str]:
    inner = agent.inner
    assert isinstance(inner, BranchAgent)
    with inner._lock:
        return list(inner.answers)


def caller(clients: Callable[..., Api], server: ServerThread, key: str | None = None) -> Api:
    api = clients(server.base_url)
    if key is not None:
        api.http.headers["Authorization"] = f"Bearer {key}"
    return api


def ask(api: Api, conv: str, **body: Any) -> str:
    response = api.http.post(f"/api/conversations/{conv}/runs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["run_id"])


def answered(api: Api, conv: str, **body: Any) -> str:
    """Start a run with ``body`` and wait for it to complete; its id."""
    run_id = ask(api, conv, **body)
    run = api.wait_finished(run_id)
    assert run["status"] == "completed", run
    return run_id


def branch(api: Api, conv: str) -> list[dict[str, Any]]:
    """The conversation's current branch, as ``GET /api/conversations/{id}`` has it."""
    response = api.http.get(f"/api/conversations/{conv}")
    assert response.status_code == 200, response.text
    return list(response.json()["messages"])


def texts(messages: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [(m["role"], m["content"]) for m in messages]


def loop_histories(agent: GatedAgent, question: str) -> list[list[tuple[str, str | None]]]:
    """For each loop call that asked ``question`` (its last message), in order: the messages the
    engine sent before it, the system prompt left out."""
    found = []
    for body in list(agent.requests):
        if body.get("stream") or _forced_function(body) is not None:
            continue
        messages = body["messages"]
        if messages[-1]["role"] == "user" and messages[-1]["content"] == question:
            assert messages[0]["role"] == "system"
            found.append([(m["role"], m.get("content")) for m in messages[1:-1]])
    return found


def stored(database_url: str, conv: str) -> list[MessageRecord]:
    """Every message of the conversation in the database, of every branch."""

    async def read() -> list[MessageRecord]:
        db = Database(database_url)
        try:
            return await ConversationRepo(db.sessionmaker).messages(conv)
        finally:
            await db.dispose()

    return run_in_own_loop(read)


def test_messages_form_a_tree_and_an_edit_asks_on_a_branch_whose_runs_see_nothing_of_the_others(
    start_service: Callable[..., ServerThread], agent: GatedAgent, clients: Callable[..., Api]
) -> None:
    api = caller(clients, start_service(redis=False))
    conv = api.create_conversation()
    questions = ["how far is the moon?", "and the sun?", "and mars?"]
    runs = [answered(api, conv, message=q) for q in questions]

    first = branch(api, conv)
    given = answers(agent)
    assert [(m["role"], m["content"], m["run_id"]) for m in first] == [
        item
        for q, a, run in zip(questions, given, runs, strict=True)
        for item in (("user", q, run), ("assistant", a, run))
    ]
    ids = [m["id"] for m in first]
    assert all(re.fullmatch(r"msg_[0-9]+", i) for i in ids) and len(set(ids)) == 6, ids
    assert [m["parent_id"] for m in first] == [None, *ids[:-1]]
    assert [m["sibling_ids"] for m in first] == [[i] for i in ids]
    # Each run's history was the path before its question.
    assert [loop_histories(agent, q) for q in questions] == [[[]], [texts(first[:2])], [texts(first[:4])]]

    # An edit of the second question: a new question below its parent, the first answer.
    edit = answered(api, conv, message="and the sun, in miles?", parent_id=ids[1])

    edited = branch(api, conv)
    assert edited[:2] == first[:2]
    question, answer = edited[2:]
    assert texts([question, answer]) == [
        ("user", "and the sun, in miles?"),
        ("assistant", answers(agent)[-1]),
    ]
    assert (question["parent_id"], question["sibling_ids"]) == (ids[1], [ids[2], question["id"]])
    assert (answer["parent_id"], answer["sibling_ids"]) == (question["id"], [answer["id"]])
    assert (question["run_id"], answer["run_id"]) == (edit, edit)
    assert question["id"] not in ids and answer["id"] not in ids
    assert loop_histories(agent, "and the sun, in miles?") == [texts(first[:2])]

    # Without parent_id a question goes below the current leaf: the edit's branch.
    later = answered(api, conv, message="and jupiter?")
    assert loop_histories(agent, "and jupiter?") == [texts(edited)]
    assert [m["run_id"] for m in branch(api, conv)[4:]] == [later, later]

    # An edit of the first message (parent_id null) starts a second root.
    root = answered(api, conv, message="how far is the moon, in km?", parent_id=None)
    rooted = branch(api, conv)
    assert texts(rooted) == [("user", "how far is the moon, in km?"), ("assistant", answers(agent)[-1])]
    assert (rooted[0]["parent_id"], rooted[0]["sibling_ids"]) == (None, [ids[0], rooted[0]["id"]])
    assert (rooted[1]["parent_id"], rooted[1]["run_id"]) == (rooted[0]["id"], root)
    assert loop_histories(agent, "how far is the moon, in km?") == [[]]


def test_regenerate_answers_the_stored_question_again_with_a_sibling_answer(
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    api = caller(clients, start_service(redis=False))
    conv = api.create_conversation()
    answered(api, conv, message="name a colour")
    answered(api, conv, message="name a fruit")
    before = branch(api, conv)
    ids = [m["id"] for m in before]

    # An assistant message: replaced by a new answer to the same question, its sibling.
    again = answered(api, conv, regenerate=ids[3])

    after = branch(api, conv)
    assert after[:3] == before[:3]  # the question is the same message, with no sibling
    new = after[3]
    assert (new["role"], new["content"], new["run_id"]) == ("assistant", answers(agent)[-1], again)
    assert new["content"] != before[3]["content"]
    assert (new["parent_id"], new["sibling_ids"]) == (ids[2], [ids[3], new["id"]])
    assert loop_histories(agent, "name a fruit") == [texts(before[:2]), texts(before[:2])]

    # A user message: answered again, the new answer a sibling of its first one.
    first_again = answered(api, conv, regenerate=ids[0])

    regenerated = branch(api, conv)
    assert regenerated[0] == before[0]
    assert texts(regenerated[1:]) == [("assistant", answers(agent)[-1])]
    assert (regenerated[1]["parent_id"], regenerated[1]["run_id"]) == (ids[0], first_again)
    assert regenerated[1]["sibling_ids"] == [ids[1], regenerated[1]["id"]]
    assert loop_histories(agent, "name a colour") == [[], []]

    # Each question is stored once; each regenerate stored one answer.
    messages = stored(migrated_database_url, conv)
    assert sorted(m.content or "" for m in messages if m.role == "user") == ["name a colour", "name a fruit"]
    assert [m.content for m in messages if m.role == "assistant"] == answers(agent)


def test_switch_makes_the_newest_leaf_below_a_message_current_and_fork_copies_a_path(
    start_service: Callable[..., ServerThread], agent: GatedAgent, clients: Callable[..., Api]
) -> None:
    server = start_service(redis=False, api_keys=KEYS)
    alice, bob = caller(clients, server, "key-alice"), caller(clients, server, "key-bob")
    conv = alice.create_conversation(system_prompt="Answer briefly.")
    answered(alice, conv, message="pick a number")
    answered(alice, conv, message="double it")
    older = branch(alice, conv)
    answered(alice, conv, message="triple it", parent_id=older[1]["id"])
    newer = branch(alice, conv)
    assert newer[:2] == older[:2] and newer[2]["sibling_ids"] == [older[2]["id"], newer[2]["id"]]

    def switch(api: Api, message_id: str) -> httpx.Response:
        return api.http.put(f"/api/conversations/{conv}/head", json={"message_id": message_id})

    # To the older branch: its question's newest leaf is its answer.
    response = switch(alice, older[2]["id"])
    assert response.status_code == 200, response.text
    assert response.json()["id"] == conv
    assert response.json()["messages"] == branch(alice, conv)
    assert [m["id"] for m in response.json()["messages"]] == [m["id"] for m in older]
    assert texts(response.json()["messages"]) == texts(older)
    # A question without parent_id now goes on below the older branch's leaf.
    answered(alice, conv, message="and halve it")
    longest = branch(alice, conv)
    assert [m["id"] for m in longest[:4]] == [m["id"] for m in older]
    assert loop_histories(agent, "and halve it") == [texts(older)]

    # Back to the other branch, by its question: its leaf is its answer.
    assert switch(alice, newer[2]["id"]).json()["messages"] == branch(alice, conv) == newer
    # From the first answer, below which both branches go on: the newest leaf of all.
    assert switch(alice, older[1]["id"]).json()["messages"] == longest
    # A message that is a leaf itself.
    assert switch(alice, newer[3]["id"]).json()["messages"] == newer

    # Fork at the older branch's answer: a new conversation holding a copy of that path.
    source = alice.http.get(f"/api/conversations/{conv}").json()
    forked = alice.http.post(
        f"/api/conversations/{conv}/fork", json={"message_id": older[3]["id"], "title": "the doubled one"}
    )

    assert forked.status_code == 201, forked.text
    fork = forked.json()
    assert fork["id"] != conv and fork["title"] == "the doubled one"
    assert fork["agent"] == source["agent"] and source["agent"]["system_prompt"] == "Answer briefly."
    copied = branch(alice, fork["id"])
    assert texts(copied) == texts(older)
    copy_ids = [m["id"] for m in copied]
    assert not set(copy_ids) & {m["id"] for m in longest + newer}
    assert [m["parent_id"] for m in copied] == [None, *copy_ids[:-1]]
    assert [m["sibling_ids"] for m in copied] == [[i] for i in copy_ids]
    assert alice.http.get(f"/api/conversations/{conv}").json() == source  # the original is unchanged
    listed = alice.http.get("/api/conversations").json()["items"]
    assert sorted(c["id"] for c in listed) == sorted([conv, fork["id"]])
    # The fork goes on from the copied path.
    answered(alice, fork["id"], message="and add one")
    assert loop_histories(agent, "and add one") == [texts(older)]
    untitled = alice.http.post(f"/api/conversations/{conv}/fork", json={"message_id": older[1]["id"]})
    assert untitled.status_code == 201, untitled.text
    assert untitled.json()["title"] == f"{source['title']} (fork)"
    assert texts(branch(alice, untitled.json()["id"])) == texts(older[:2])

    # Another owner sees none of it and cannot fork or switch it.
    assert bob.http.get(f"/api/conversations/{fork['id']}").status_code == 404
    assert (
        bob.http.post(f"/api/conversations/{conv}/fork", json={"message_id": older[1]["id"]}).status_code
        == 404
    )
    assert switch(bob, older[2]["id"]).status_code == 404
    assert bob.http.get("/api/conversations").json()["items"] == []
    assert alice.http.get(f"/api/conversations/{conv}").json() == source


@pytest.mark.parametrize("held_by", ["a model call", "an approval"])
def test_while_a_run_is_active_edit_regenerate_switch_fork_and_replay_answer_409_and_change_nothing(
    held_by: str,
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    api = caller(clients, start_service(redis=False))
    conv = api.create_conversation(require_approval=["calculator"])
    done_run = answered(api, conv, message="first question")
    first = branch(api, conv)
    event_id = api.events(done_run)[0]["id"]

    if held_by == "a model call":
        agent.close_gate()
        question = "second question"
        active = ask(api, conv, message=question)
        wait_until(lambda: loop_histories(agent, question), timeout=10, what="the run's loop call")
    else:
        question = "please calculate 6*7"
        active = ask(api, conv, message=question)
        wait_until(lambda: api.run(active)["status"] == "waiting", timeout=10, what="the run to wait")
    during = api.http.get(f"/api/conversations/{conv}").json()
    assert during["active_run_id"] == active

    refused = {
        "edit": api.http.post(
            f"/api/conversations/{conv}/runs", json={"message": "x", "parent_id": first[1]["id"]}
        ),
        "edit the first": api.http.post(
            f"/api/conversations/{conv}/runs", json={"message": "x", "parent_id": None}
        ),
        "regenerate an answer": api.http.post(
            f"/api/conversations/{conv}/runs", json={"regenerate": first[1]["id"]}
        ),
        "regenerate a question": api.http.post(
            f"/api/conversations/{conv}/runs", json={"regenerate": first[0]["id"]}
        ),
        "switch": api.http.put(f"/api/conversations/{conv}/head", json={"message_id": first[0]["id"]}),
        "fork": api.http.post(f"/api/conversations/{conv}/fork", json={"message_id": first[1]["id"]}),
        "replay": api.http.post(f"/api/runs/{done_run}/replay", json={"after": event_id}),
    }

    assert {name: r.status_code for name, r in refused.items()} == dict.fromkeys(refused, 409)
    assert {name: r.json()["error"]["code"] for name, r in refused.items()} == dict.fromkeys(
        refused, "run_active"
    )
    assert api.http.get(f"/api/conversations/{conv}").json() == during
    assert [c["id"] for c in api.http.get("/api/conversations").json()["items"]] == [conv]
    if held_by == "a model call":
        agent.gate.set()
    else:
        (approval,) = during["pending_approvals"]
        decided = api.http.post(
            f"/api/conversations/{conv}/approvals/{approval['approval_id']}", json={"decision": "approve"}
        )
        assert decided.status_code == 200, decided.text
    assert api.wait_finished(active)["status"] == "completed"
    final = branch(api, conv)
    assert final[:2] == first
    assert texts(final[2:3] + final[-1:]) == [("user", question), ("assistant", answers(agent)[-1])]
    assert {m["run_id"] for m in final[2:]} == {active}
    assert [m.content for m in stored(migrated_database_url, conv)] == [m["content"] for m in final]
    assert loop_histories(agent, "x") == []


def test_bad_bodies_are_422_other_conversations_and_owners_messages_404_and_nothing_changes(
    start_service: Callable[..., ServerThread],
    agent: GatedAgent,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    server = start_service(redis=False, api_keys=KEYS)
    alice, bob = caller(clients, server, "key-alice"), caller(clients, server, "key-bob")
    conv, other, bobs = alice.create_conversation(), alice.create_conversation(), bob.create_conversation()
    answered(alice, conv, message="please calculate 6*7")
    answered(alice, other, message="another question")
    answered(bob, bobs, message="bob's question")
    mine, elsewhere, of_bob = branch(alice, conv), branch(alice, other), branch(bob, bobs)
    question, calling, result, answer = mine
    assert (calling["role"], bool(calling["tool_calls"]), result["role"]) == ("assistant", True, "tool")

    def state() -> Any:
        return (
            [alice.http.get(f"/api/conversations/{c}").json() for c in (conv, other)],
            bob.http.get(f"/api/conversations/{bobs}").json(),
            alice.http.get("/api/conversations").json(),
            bob.http.get("/api/conversations").json(),
            [
                [(m.id, m.parent_seq, m.content) for m in stored(migrated_database_url, c)]
                for c in (conv, other, bobs)
            ],
        )

    before = state()
    runs, head, fork = (
        f"/api/conversations/{conv}/runs",
        f"/api/conversations/{conv}/head",
        f"/api/conversations/{conv}/fork",
    )
    invalid: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", runs, {"message": "x", "regenerate": answer["id"]}),
        ("POST", runs, {"regenerate": answer["id"], "parent_id": None}),
        ("POST", runs, {"regenerate": answer["id"], "parent_id": question["id"]}),
        ("POST", runs, {}),
        ("POST", runs, {"parent_id": answer["id"]}),
        ("POST", runs, {"message": "x", "parent_id": answer["id"], "branch": 2}),
        ("POST", runs, {"regenerate": answer["id"], "model": "default"}),
        *[
            ("POST", runs, {"message": "x", "parent_id": bad})
            for bad in ("1", "msg_", "msg_x", "msg_-1", 7, "msg_" + "9" * 40, [answer["id"]], {"id": 1})
        ],
        ("POST", runs, {"regenerate": "m" + answer["id"]}),
        # A question cannot follow an assistant message that calls tools, before their results.
        ("POST", runs, {"message": "x", "parent_id": calling["id"]}),
        # A tool's result is neither a question nor an answer.
        ("POST", runs, {"regenerate": result["id"]}),
        ("PUT", head, {}),
        ("PUT", head, {"message_id": None}),
        ("PUT", head, {"message_id": "1"}),
        ("PUT", head, {"message_id": answer["id"], "leaf": True}),
        ("POST", fork, {}),
        ("POST", fork, {"message_id": 5}),
        # A fork goes on from its last message: one a question can follow, as for an edit.
        ("POST", fork, {"message_id": calling["id"]}),
        ("POST", fork, {"message_id": answer["id"], "owner": "bob"}),
    ]
    not_found: list[tuple[Api, str, str, dict[str, Any]]] = [
        # Another conversation's messages, of the same owner and of another.
        *[
            (alice, method, url, body)
            for foreign in (elsewhere[1]["id"], of_bob[1]["id"], "msg_999999999")
            for method, url, body in (
                ("POST", runs, {"message": "x", "parent_id": foreign}),
                ("POST", runs, {"regenerate": foreign}),
                ("PUT", head, {"message_id": foreign}),
                ("POST", fork, {"message_id": foreign}),
            )
        ],
        # Another owner's conversation, with its own message ids.
        (bob, "POST", runs, {"message": "x", "parent_id": answer["id"]}),
        (bob, "POST", runs, {"regenerate": answer["id"]}),
        (bob, "PUT", head, {"message_id": question["id"]}),
        (bob, "POST", fork, {"message_id": answer["id"]}),
    ]

    for method, url, body in invalid:
        response = alice.http.request(method, url, json=body)
        assert response.status_code == 422, (method, url, body, response.text)
        assert response.json()["error"]["code"] == "invalid_request", response.text
    for api, method, url, body in not_found:
        response = api.http.request(method, url, json=body)
        assert response.status_code == 404, (
            api.http.headers["Authorization"],
            method,
            url,
            body,
            response.text,
        )
        assert response.json()["error"]["code"] == "not_found", response.text

    assert state() == before
    assert loop_histories(agent, "x") == []


# -- a run on a branch whose worker is killed ----------------------------------------------------


@pytest.fixture
def two_workers(migrated_database_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """Worker processes "a" and "b" on this test's database and Redis, the fake model playing a
    ``BranchAgent``."""
    with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
        llm.agent.inner = BranchAgent()
        cluster = Cluster(migrated_database_url, llm, prefix, tmp_path)
        try:
            cluster.start_roles({"a": {"RUN_LEASE_S": "2"}, "b": {"RUN_LEASE_S": "2"}})
            yield cluster
        finally:
            cluster.close()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(90)
def test_an_edit_whose_worker_is_killed_is_carried_on_by_another_worker_on_its_branch(
    two_workers: Cluster, clients: Callable[..., Api]
) -> None:
    agent = two_workers.llm.agent
    a, b = clients(two_workers.role("a").base_url), clients(two_workers.role("b").base_url)
    conv = a.create_conversation()
    answered(a, conv, message="what is a comet?")
    answered(a, conv, message="and an asteroid?")
    old = branch(a, conv)

    agent.close_gate()
    run_id = ask(a, conv, message="and a meteor?", parent_id=old[1]["id"])
    wait_until(lambda: loop_histories(agent, "and a meteor?"), timeout=15, what="the edit's loop call on A")
    two_workers.role("a").kill()
    agent.gate.set()

    run = b.wait_finished(run_id, timeout=30)
    assert (run["status"], run["attempt"]) == ("completed", 2), run
    now = branch(b, conv)
    assert now[:2] == old[:2]
    question, answer = now[2:]
    assert texts([question, answer]) == [("user", "and a meteor?"), ("assistant", run["answer"])]
    assert run["answer"] == answers(agent)[-1]
    assert (question["parent_id"], question["sibling_ids"]) == (old[1]["id"], [old[2]["id"], question["id"]])
    assert (answer["parent_id"], answer["sibling_ids"]) == (question["id"], [answer["id"]])
    assert (question["run_id"], answer["run_id"]) == (run_id, run_id)
    # Both attempts' history was the edit's path, nothing of the older branch.
    histories = loop_histories(agent, "and a meteor?")
    assert len(histories) == 2 and histories == [texts(old[:2])] * 2
    # The older branch is intact beside it.
    switched = b.http.put(f"/api/conversations/{conv}/head", json={"message_id": old[2]["id"]})
    assert switched.status_code == 200, switched.text
    assert switched.json()["messages"] == [
        *old[:2],
        {**old[2], "sibling_ids": [old[2]["id"], question["id"]]},
        old[3],
    ]
