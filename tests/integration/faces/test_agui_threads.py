"""AG-UI threads (FACES.md G-02, G-03): a ``threadId`` names one conversation per owner, created at
first use with the earlier messages as its history; the client sends its whole history every time
and only what the conversation lacks is stored; the ids of the events, of later snapshots and of
the history the client sends back are the same. Every response passes ``ag-ui-validate``.

What a request costs does not grow with the thread: a finished run's messages are folded from its
events once per process, the runs a snapshot lacks are read together, and a question from a client
that holds the thread reads no earlier run's events and gets no whole-thread snapshot back.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from app.api.faces.agui import snapshot
from app.db.repositories.events import EventRepo
from app.streaming.bus import StoredEvent
from tests.integration.faces.agui_support import (  # noqa: F401  (fixtures)
    ALICE,
    KEYS,
    AgUi,
    Response,
    alice_fixture,
    bob_fixture,
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
from tests.support.server import ServerThread

pytestmark = pytest.mark.timeout(30)


def ids_in_events(response: Response) -> set[str]:
    """Every message and call id a response's events named."""
    out: set[str] = set()
    for event in response.events:
        for key in ("messageId", "toolCallId", "parentMessageId"):
            if isinstance(event.get(key), str):
                out.add(event[key])
    return out


def ids_in(messages: list[dict[str, Any]]) -> set[str]:
    return {m["id"] for m in messages} | {c["id"] for m in messages for c in m.get("toolCalls") or ()}


def event_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of stored events the service makes from now on, of a run's (``run <id>``) or of
    a conversation's from its start (``conversation``); reads after a cursor (a stream's) are not
    counted."""
    reads: list[str] = []
    for_run, read_after = EventRepo.for_run, EventRepo.read_after

    async def counted_for_run(self: EventRepo, run_id: str) -> list[StoredEvent]:
        reads.append(f"run {run_id}")
        return await for_run(self, run_id)

    async def counted_read_after(
        self: EventRepo, conversation_id: str, after: str, limit: int = 1000
    ) -> list[StoredEvent]:
        if after == "0-0":
            reads.append("conversation")
        return await read_after(self, conversation_id, after, limit)

    monkeypatch.setattr(EventRepo, "for_run", counted_for_run)
    monkeypatch.setattr(EventRepo, "read_after", counted_read_after)
    return reads


def thread_of_runs(alice: AgUi, runs: int) -> str:
    """A thread of ``runs`` runs, each asked by a client that held the thread."""
    thread = thread_id()
    for n in range(runs):
        held = alice.thread(thread) if n else []
        response = alice.post(run_input(thread, [*held, user(f"question {n}", f"q-{n}")]))
        assert response.last["type"] == "RUN_FINISHED"
    return thread


def test_a_finished_runs_messages_are_folded_once_and_a_snapshot_reads_no_earlier_run(
    alice: AgUi, gated_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    thread = thread_of_runs(alice, 4)
    held = alice.thread(thread)
    reads = event_reads(monkeypatch)

    assert alice.thread(thread) == held
    assert reads == []
    # A question from a client that holds the thread: nothing of the earlier runs is read, and
    # the response ends without the whole thread (the events told the client the new run).
    asked = alice.post(run_input(thread, [*held, user("one more", "q-last")]))
    assert asked.last["type"] == "RUN_FINISHED" and "MESSAGES_SNAPSHOT" not in asked.kinds
    assert reads == []


def test_the_runs_a_snapshot_lacks_are_read_in_one_pass(
    alice: AgUi, gated_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    thread = thread_of_runs(alice, 3)
    held = alice.thread(thread)
    # A worker that never folded them (just started, or another one): none kept.
    monkeypatch.setattr(snapshot, "_FINISHED", OrderedDict(), raising=False)
    reads = event_reads(monkeypatch)

    assert alice.thread(thread) == held
    assert reads == ["conversation"]
    reads.clear()
    assert alice.thread(thread) == held
    assert reads == []


def stored(alice: AgUi) -> list[tuple[str, str | None]]:
    return [(m["role"], m["content"]) for m in alice.only_conversation()["messages"]]


def test_a_thread_used_again_keeps_its_ids_and_what_the_client_sends_back_is_not_stored_twice(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    agent = play(gated_llm, ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    thread = thread_id()
    first = alice.post(
        run_input(thread, [user("what is 6*7?", "q-1")], forwardedProps={"agent": {"mode": "json"}})
    )
    after_first = stored(alice)
    held = alice.thread(thread)

    # Ids in the events are the snapshot's (reasoning, the call's reply, the call, its result, the answer).
    named = ids_in_events(first)
    assert len(named) >= 6 and named <= ids_in(held)

    # The history sent back as it is, with nothing new: the thread as it was, nothing stored.
    again = alice.post(run_input(thread, held))
    assert again.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert again.snapshot == held
    assert stored(alice) == after_first

    # Sent back with a new question (as CopilotKit does): only the question is new.
    second = alice.post(run_input(thread, [*held, user("and once more?", "q-2")]))
    assert second.last["type"] == "RUN_FINISHED"
    now = alice.thread(thread)
    assert now[: len(held)] == held
    assert now[len(held)] == {"id": "q-2", "role": "user", "content": "and once more?"}
    assert stored(alice)[: len(after_first)] == after_first
    contents = [content for _, content in stored(alice)]
    assert contents.count("what is 6*7?") == contents.count("and once more?") == 1
    assert len(alice.conversations()) == 1
    # The model read the first run as history in the second: the call, its result, the answer.
    last_ask = [b for b in gated_llm.agent.requests if not b.get("stream")][-1]
    assert "6*7 = 42" in str(last_ask["messages"]) and agent.answer in str(last_ask["messages"])


def test_a_new_threads_earlier_messages_become_its_history_under_the_clients_ids(
    alice: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    history = [
        {"id": "sys-1", "role": "system", "content": "Be brief."},
        user("my name is Ada", "h-1"),
        {"id": "h-2", "role": "assistant", "content": "Hello Ada."},
        {"id": "r-1", "role": "reasoning", "content": "a thought the client kept"},
    ]
    context = [{"description": "the page", "value": "the billing settings"}]

    response = alice.post(
        run_input(thread_id(), [*history, user("what is my name?", "q-1")], context=context)
    )

    assert response.last["type"] == "RUN_FINISHED"
    assert [(m["id"], m["role"]) for m in response.snapshot[:3]] == [
        ("sys-1", "system"),
        ("h-1", "user"),
        ("h-2", "assistant"),
    ]
    question = next(
        m for m in response.snapshot if m["role"] == "user" and m["content"] == "what is my name?"
    )
    assert question["id"] == "q-1"
    asked = next(b for b in gated_llm.agent.requests if not b.get("stream"))
    sent = str(asked["messages"])
    assert "my name is Ada" in sent and "Hello Ada." in sent and "the billing settings" in sent
    assert "a thought the client kept" not in sent


def test_two_owners_with_the_same_thread_id_have_two_conversations(
    alice: AgUi, bob: AgUi, gated_llm: FakeLLM
) -> None:
    play(gated_llm, EchoAgentBehaviour())
    thread = thread_id()

    alices = alice.post(run_input(thread, [user("alice's secret question", "a-1")]))
    bobs = bob.post(run_input(thread, [user("bob's question", "b-1")]))

    bobs_thread = bob.thread(thread)
    assert [m["content"] for m in alice.thread(thread) if m["role"] == "user"] == ["alice's secret question"]
    assert [m["content"] for m in bobs_thread if m["role"] == "user"] == ["bob's question"]
    assert alices.last["result"]["run_id"] != bobs.last["result"]["run_id"]
    (mine,), (theirs,) = alice.conversations(), bob.conversations()
    assert mine["id"] != theirs["id"]
    # Bob's thread does not know Alice's message ids: hers sent in his thread are a question.
    reuse = bob.post(run_input(thread, [*bobs_thread, user("alice's secret question", "a-1")]))
    assert reuse.last["type"] == "RUN_FINISHED" and "result" in reuse.last
    assert alice.http.get(f"/api/conversations/{theirs['id']}").status_code == 404
    assert len(alice.only_conversation()["messages"]) == 2


def test_a_new_thread_whose_run_is_refused_leaves_no_conversation_behind(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM
) -> None:
    service = start_service(redis=False, api_keys=KEYS, max_active_runs=1, max_queued_runs=0)
    alice = AgUi(service.base_url, ALICE)
    try:
        play(gated_llm, EchoAgentBehaviour())
        gated_llm.agent.close_gate()
        busy = in_background(lambda: alice.post(run_input(thread_id(), [user("first")])))
        before = alice.active_conversation()
        thread = thread_id()
        body = run_input(thread, [user("my name is Ada", "h-1"), user("what is my name?", "q-1")])

        refused = alice.post(body)  # the one place is taken and no run may queue

        assert refused.status == 429 and json.loads(refused.body)["error"]["code"] == "queue_full"
        assert [c["id"] for c in alice.conversations()] == [before["id"]]
        gated_llm.agent.gate.set()
        assert busy.result(timeout=20).last["type"] == "RUN_FINISHED"
        # The thread is new again: created at this use, with its history once.
        again = alice.post(body)
        assert again.last["type"] == "RUN_FINISHED" and "result" in again.last
        assert [m["id"] for m in again.snapshot if m["role"] == "user"] == ["h-1", "q-1"]
        assert len(alice.conversations()) == 2
    finally:
        gated_llm.agent.gate.set()
        alice.close()
