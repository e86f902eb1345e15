"""The A2A face (FACES.md N-01..N-05) driven by the official ``a2a-sdk`` client against a started
service on the fake model: a streamed task to COMPLETED with its answer as an artifact (JSON-RPC
and HTTP+JSON), a task that waits for an approval and the decision sent as a message, a
resubscription through another worker after the connection is cut (and one while the task parks:
it waits for input already), cancel, a follow-up on a working task (neither reaching the next task
of the context once the task has ended), GetTask and ListTasks (owners apart), and the errors of
A2A 5.4.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Part,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import (
    ContentTypeNotSupportedError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from app.db.repositories import RunRecord
from tests.integration.faces.a2a_support import (
    ALICE,
    BOB,
    CANCELED,
    COMPLETED,
    INPUT_REQUIRED,
    JSONRPC,
    KEYS,
    REST,
    V1,
    WORKING,
    a2a_client,
    artifact_text,
    collect,
    context_id,
    data,
    data_parts,
    kinds,
    last_chunk,
    message,
    send,
    states,
    task_answer,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    GatedAgent,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.server import ServerThread, async_wait_until, wait_until

pytestmark = pytest.mark.timeout(60)

APPROVING = {"mode": "json", "tools": ["calculator"], "require_approval": ["calculator"]}


@pytest.fixture
def service(start_service: Callable[..., ServerThread]) -> ServerThread:
    return start_service(redis=False, api_keys=KEYS)


def run_record(service: ServerThread, run_id: str) -> dict[str, object]:
    response = httpx.get(f"{service.base_url}/api/runs/{run_id}", headers=ALICE, timeout=10)
    assert response.status_code == 200, response.text
    record: dict[str, object] = response.json()
    return record


@pytest.mark.parametrize("binding", [JSONRPC, REST])
async def test_a_streamed_task_completes_with_its_answer_as_an_artifact(
    service: ServerThread, gated_llm: FakeLLM, binding: str
) -> None:
    agent = gated_llm.agent
    agent.inner = EchoAgentBehaviour(12, delay_s=0.02)  # tokens apart: a chunk each
    async with a2a_client(service.base_url, binding=binding) as client:
        events = await collect(client.send_message(send(message("what is 6*7?"))))

        first = events[0]
        assert first.HasField("task"), kinds(events)
        task = first.task
        assert task.status.state in (TaskState.TASK_STATE_SUBMITTED, WORKING)
        assert [p.text for p in task.history[0].parts] == ["what is 6*7?"]
        assert task.context_id  # made for it, as none was sent
        assert states(events)[-1] == COMPLETED
        assert set(states(events[:-1])) <= {WORKING}, states(events)
        # The answer, chunk by chunk (the first replaces, the others append, the last says so).
        assert artifact_text(events) == agent.answer
        assert last_chunk(events)
        assert sum(e.HasField("artifact_update") for e in events) > 2

        done = await client.get_task(GetTaskRequest(id=task.id))
        assert done.status.state == COMPLETED and task_answer(done) == agent.answer
        assert done.context_id == task.context_id
    # The same run through the own API.
    record = run_record(service, task.id)
    assert (record["status"], record["answer"]) == ("completed", agent.answer)


async def test_a_task_waits_for_approval_then_a_decision_message_carries_it_on(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    async with a2a_client(service.base_url) as client:
        first = await collect(client.send_message(send(message("what is 6*7?"), agent=APPROVING)))
        task = first[0].task
        # The stream ends where the run waits for a person.
        assert states(first)[-1] == INPUT_REQUIRED
        waiting = first[-1].status_update.status.message
        (asked,) = data_parts(waiting)
        assert (asked["tool_name"], asked["tool_args"]) == ("calculator", {"expression": "6*7"})
        assert asked["approval_id"] and asked["expires_at"]
        polled = await client.get_task(GetTaskRequest(id=task.id))
        assert polled.status.state == INPUT_REQUIRED
        assert data_parts(polled.status.message) == [asked]

        # A message on the task without a decision does not settle it.
        with pytest.raises(InvalidParamsError):
            await collect(client.send_message(send(message("go on", task_id=task.id))))

        decision = message(
            data({"approval_id": asked["approval_id"], "decision": "approve", "reason": "fine"}),
            task_id=task.id,
            context_id=task.context_id,
        )
        rest = await collect(client.send_message(send(decision)))
        assert rest[0].HasField("task") and rest[0].task.id == task.id
        assert states(rest)[-1] == COMPLETED, states(rest)
        assert artifact_text(rest) == gated_llm.agent.answer
        decided = [
            e.status_update.status.message.parts[0].text
            for e in rest
            if e.HasField("status_update") and e.status_update.status.message.parts
        ]
        assert any("approved" in line for line in decided), decided
        assert any("calculator answered" in line for line in decided), decided
    record = run_record(service, task.id)
    assert record["status"] == "completed" and record["pending_approvals"] == []


async def test_a_denial_as_a_message_is_the_model_s_observation(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    async with a2a_client(service.base_url, streaming=False) as client:
        (first,) = await collect(client.send_message(send(message("what is 6*7?"), agent=APPROVING)))
        assert first.task.status.state == INPUT_REQUIRED  # blocking: until it waits
        deny = message(data({"decision": "deny", "reason": "not now"}), task_id=first.task.id)
        (done,) = await collect(client.send_message(send(deny)))
        assert done.task.status.state == COMPLETED
    assert gated_llm.agent.saw("not now")


async def test_a_resubscribe_after_the_connection_is_cut_gets_the_task_then_the_rest_through_another_worker(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM
) -> None:
    first_worker = start_service(redis=True, api_keys=KEYS)
    second_worker = start_service(redis=True, api_keys=KEYS)
    agent = gated_llm.agent
    agent.close_gate()  # the run waits in its first model call
    async with a2a_client(first_worker.base_url) as client:
        stream = client.send_message(send(message("what is 6*7?")))
        opening = await anext(stream)
        await stream.aclose()  # the connection is cut
    task = opening.task
    await asyncio.to_thread(wait_until, lambda: agent.loop_calls >= 1, 10)

    async with a2a_client(second_worker.base_url) as client:
        resumed = client.subscribe(SubscribeToTaskRequest(id=task.id))
        snapshot = await anext(resumed)
        assert snapshot.HasField("task") and snapshot.task.id == task.id
        assert snapshot.task.status.state == WORKING
        agent.gate.set()
        rest = await collect(resumed)
    assert states(rest)[-1] == COMPLETED
    assert artifact_text(rest, task_answer(snapshot.task)) == agent.answer
    assert last_chunk(rest)


async def test_cancel_ends_a_working_task_canceled(service: ServerThread, gated_llm: FakeLLM) -> None:
    agent = gated_llm.agent
    agent.close_gate()
    async with a2a_client(service.base_url, streaming=False) as client:
        (sent,) = await collect(client.send_message(send(message("count to ten"), return_immediately=True)))
        task = sent.task
        assert task.status.state in (TaskState.TASK_STATE_SUBMITTED, WORKING)
        cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
        assert cancelled.id == task.id and cancelled.status.state == CANCELED
        assert (await client.get_task(GetTaskRequest(id=task.id))).status.state == CANCELED
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(CancelTaskRequest(id=task.id))
    assert run_record(service, task.id)["status"] == "cancelled"


async def test_a_message_on_a_working_task_is_a_follow_up(service: ServerThread, gated_llm: FakeLLM) -> None:
    agent = gated_llm.agent
    agent.close_gate()
    async with a2a_client(service.base_url) as client:
        stream = client.send_message(send(message("what is 6*7?")))
        task = (await anext(stream)).task
        await stream.aclose()
        await asyncio.to_thread(wait_until, lambda: agent.loop_calls >= 1, 10)

        follow_up = client.send_message(send(message("and in hex, please", task_id=task.id)))
        snapshot = await anext(follow_up)
        assert snapshot.task.id == task.id and snapshot.task.status.state == WORKING
        agent.gate.set()
        rest = await collect(follow_up)
    assert states(rest)[-1] == COMPLETED
    lines = [
        e.status_update.status.message.parts[0].text
        for e in rest
        if e.HasField("status_update") and e.status_update.status.message.parts
    ]
    assert "follow-up taken in" in lines, lines
    assert agent.saw("and in hex, please")
    assert run_record(service, task.id)["status"] == "completed"


async def test_get_task_and_list_tasks_keep_owners_apart(service: ServerThread, gated_llm: FakeLLM) -> None:
    ctx = context_id()
    async with a2a_client(service.base_url, streaming=False) as alice:
        (one,) = await collect(alice.send_message(send(message("first", context_id=ctx))))
        (two,) = await collect(alice.send_message(send(message("second", context_id=ctx))))
        (other,) = await collect(alice.send_message(send(message("elsewhere"))))
        assert one.task.context_id == two.task.context_id == ctx
        assert other.task.context_id != ctx

        in_context = await alice.list_tasks(ListTasksRequest(context_id=ctx))
        assert [t.id for t in in_context.tasks] == [two.task.id, one.task.id]  # newest first
        assert in_context.next_page_token == "" and in_context.total_size == 2
        assert all(not t.artifacts for t in in_context.tasks)  # includeArtifacts is off by default

        everything = await alice.list_tasks(ListTasksRequest(include_artifacts=True))
        assert {t.id for t in everything.tasks} == {one.task.id, two.task.id, other.task.id}
        assert all(task_answer(t) == gated_llm.agent.answer for t in everything.tasks)

        pages, token = [], ""
        while True:
            page = await alice.list_tasks(ListTasksRequest(page_size=1, page_token=token))
            pages += [t.id for t in page.tasks]
            token = page.next_page_token
            if not token:
                break
        assert pages == [t.id for t in everything.tasks]

        completed = await alice.list_tasks(ListTasksRequest(status=COMPLETED, history_length=0))
        assert len(completed.tasks) == 3 and all(not t.history for t in completed.tasks)

        got = await alice.get_task(GetTaskRequest(id=one.task.id, history_length=0))
        assert got.status.state == COMPLETED and not got.history

    async with a2a_client(service.base_url, BOB, streaming=False) as bob:
        assert list((await bob.list_tasks(ListTasksRequest())).tasks) == []
        assert list((await bob.list_tasks(ListTasksRequest(context_id=ctx))).tasks) == []
        with pytest.raises(TaskNotFoundError):
            await bob.get_task(GetTaskRequest(id=one.task.id))
        with pytest.raises(TaskNotFoundError):
            await bob.cancel_task(CancelTaskRequest(id=one.task.id))
        with pytest.raises(TaskNotFoundError):
            await collect(bob.send_message(send(message("mine now", task_id=one.task.id))))
        # Bob's context of the same id is his own conversation.
        (bobs,) = await collect(bob.send_message(send(message("hello", context_id=ctx))))
        assert bobs.task.context_id == ctx
    async with a2a_client(service.base_url, streaming=False) as alice:
        assert (await alice.list_tasks(ListTasksRequest(context_id=ctx))).total_size == 2


@pytest.mark.parametrize("binding", [JSONRPC, REST])
async def test_the_errors_of_a2a_5_4(service: ServerThread, binding: str) -> None:
    async with a2a_client(service.base_url, binding=binding) as client:
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id="run_nothing"))
        with pytest.raises(TaskNotFoundError):
            await collect(client.subscribe(SubscribeToTaskRequest(id="run_nothing")))
        with pytest.raises(TaskNotFoundError):
            await collect(client.send_message(send(message("hi", task_id="run_nothing"))))

        events = await collect(client.send_message(send(message("what is 6*7?"))))
        task = events[0].task
        assert states(events)[-1] == COMPLETED
        # A terminal task takes no message and no subscription, and cannot be cancelled.
        with pytest.raises(UnsupportedOperationError):
            await collect(client.send_message(send(message("more", task_id=task.id))))
        with pytest.raises(UnsupportedOperationError):
            await collect(client.subscribe(SubscribeToTaskRequest(id=task.id)))
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(CancelTaskRequest(id=task.id))
        # File parts wait for attachments.
        file_part = Part(url="https://example.com/a.pdf", media_type="application/pdf")
        with pytest.raises(ContentTypeNotSupportedError):
            await collect(client.send_message(send(message("read this", file_part))))


async def test_a_bad_version_is_version_not_supported_in_each_binding(service: ServerThread) -> None:
    base = service.base_url
    body = {"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": {"id": "run_nothing"}}
    async with httpx.AsyncClient(headers=ALICE, timeout=10) as http:
        rpc = (await http.post(f"{base}/a2a", json=body, headers={"A2A-Version": "2.0"})).json()
        assert rpc["id"] == 7 and rpc["error"]["code"] == -32009
        assert rpc["error"]["data"][0]["reason"] == "VERSION_NOT_SUPPORTED"
        # No header is 0.3 (A2A 3.6.2), whose method names differ: a 1.0 name is not supported then.
        rpc = (await http.post(f"{base}/a2a", json=body)).json()
        assert rpc["error"]["code"] == -32009
        rest = await http.get(f"{base}/a2a/rest/tasks/run_nothing", headers={"A2A-Version": "0.9"})
        assert rest.status_code == 400
        assert rest.json()["error"]["details"][0]["reason"] == "VERSION_NOT_SUPPORTED"
        # The version may come as a query parameter too (A2A 3.6.1).
        rest = await http.get(f"{base}/a2a/rest/tasks/run_nothing", params={"A2A-Version": "1.0"})
        assert rest.status_code == 404 and rest.json()["error"]["status"] == "NOT_FOUND"
        assert (await http.post(f"{base}/a2a", json={**body, "id": 8}, headers=V1)).json()["error"][
            "code"
        ] == -32001


async def test_a_subscription_while_the_task_parks_says_it_waits_for_input(
    service: ServerThread, gated_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    # The run has asked (its approval and events stored) but its park has not committed: held
    # there, its row still says running.
    approvals = service.services.approvals
    park, parking, go_on = approvals.park, threading.Event(), threading.Event()

    async def held_park(run_id: str, attempt: int, worker_id: str) -> object:
        parking.set()
        await asyncio.to_thread(go_on.wait, 30)
        return await park(run_id, attempt, worker_id)

    monkeypatch.setattr(approvals, "park", held_park)
    try:
        async with a2a_client(service.base_url) as client:
            request = send(message("what is 6*7?"), agent=APPROVING, return_immediately=True)
            first = await collect(client.send_message(request))
            task = first[0].task
            assert await asyncio.to_thread(parking.wait, 10)
            assert run_record(service, task.id)["status"] == "running"

            subscription = client.subscribe(SubscribeToTaskRequest(id=task.id))
            snapshot = await anext(subscription)
            await subscription.aclose()
    finally:
        go_on.set()
    assert snapshot.task.status.state == INPUT_REQUIRED
    (asked,) = data_parts(snapshot.task.status.message)
    assert asked["tool_name"] == "calculator"


async def test_cancel_and_follow_ups_reach_only_their_own_task(
    service: ServerThread, gated_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = gated_llm.agent
    ctx = context_id()
    async with a2a_client(service.base_url, streaming=False) as client:
        (first,) = await collect(client.send_message(send(message("first", context_id=ctx))))
        assert first.task.status.state == COMPLETED
        agent.close_gate()
        (second,) = await collect(
            client.send_message(send(message("second", context_id=ctx), return_immediately=True))
        )
        # The requests below read the first task as it was just before it ended: the next task of
        # its context has started since.
        runs = service.services.runs
        get = runs.get

        async def as_read_before_it_ended(owner: str, run_id: str) -> RunRecord | None:
            run = await get(owner, run_id)
            if run is not None and run.id == first.task.id:
                return replace(run, status="running", finished_at=None)
            return run

        monkeypatch.setattr(runs, "get", as_read_before_it_ended)
        with pytest.raises(UnsupportedOperationError):
            await collect(client.send_message(send(message("meant for the first", task_id=first.task.id))))
        with pytest.raises(TaskNotCancelableError):
            await client.cancel_task(CancelTaskRequest(id=first.task.id))
        monkeypatch.undo()

        assert run_record(service, second.task.id)["status"] in ("queued", "running")
        agent.gate.set()

        async def completed() -> bool:
            return (await client.get_task(GetTaskRequest(id=second.task.id))).status.state == COMPLETED

        await async_wait_until(completed, what="the second task's end")
    assert not agent.saw("meant for the first")
