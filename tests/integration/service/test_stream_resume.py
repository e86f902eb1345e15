"""The event stream resumes from any cursor: nothing lost, nothing repeated (API.md, "The event stream").

A real uvicorn serves the app in a thread; clients read SSE through httpx; the model is the fake
OpenAI server streaming a long answer token by token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from app.db.repositories import EventRepo, RunRepo
from app.db.session import Database
from app.engine.events import RunDone, Usage
from app.streaming.publisher import RunPublisher
from app.streaming.redis_bus import RedisEventBus
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    BUSES,
    STACKS,
    Api,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    close_run_elsewhere,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
    thinking,
)
from tests.support.server import ServerThread
from tests.support.services import REDIS_URL

pytestmark = pytest.mark.timeout(30)


# How many events each connection reads before it hangs up; cycled until the run's done. Small
# enough that a run whose deltas the publisher merged into few events (a busy machine) still takes
# many connections: ten need 43 events.
CHUNKS = (1, 2, 3, 5, 8, 13)


@STACKS
def test_reconnecting_after_k_events_again_and_again_yields_every_stored_event_once_in_order(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=200, delay_s=0.004))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv, "count to two hundred")

    received = []
    cursor: str | None = None
    connections = 0
    while not received or received[-1].event != "done":
        k = CHUNKS[connections % len(CHUNKS)]
        # One reconnect carries its cursor as ?after= (a client that cannot set headers).
        by_query = connections == 3
        with api.stream(
            conv,
            last_event_id=None if by_query else cursor,
            after=cursor if by_query else None,
        ) as response:
            received += response.read(count=k, until=lambda e: e.event == "done")
        connections += 1
        cursor = received[-1].id
        assert connections < 400, "the stream never reached done"

    stored = api.wait_stored(run_id)
    ids = [e.id for e in received]
    assert len(set(ids)) == len(ids), "an event was delivered twice"
    assert as_stored(received) == stored
    assert connections > 10
    done = received[-1].data
    assert done["status"] == "completed"
    assert done["answer"] == agent.answer
    deltas = "".join(
        e.data["content"] for e in received if e.event == "answer" and e.data["status"] == "delta"
    )
    assert deltas == done["answer"]


@BUSES
def test_last_event_id_header_wins_over_the_after_query(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    gated_llm.play(GatedAgent(tokens=20))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    stored = api.wait_stored(api.start_run(conv))
    mid = len(stored) // 2
    assert mid > 2

    with api.stream(conv, last_event_id=stored[mid]["id"], after=stored[1]["id"]) as response:
        received = response.read()
    assert as_stored(received) == stored[mid + 1 :]

    with api.stream(conv, after=stored[1]["id"]) as response:
        received = response.read()
    assert as_stored(received) == stored[2:]


@BUSES
def test_without_a_cursor_the_stream_starts_at_the_first_event_of_the_active_or_latest_run(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=10))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    first = api.wait_stored(api.start_run(conv, "first"))

    agent.close_gate()
    second_id = api.start_run(conv, "second")
    with api.stream(conv) as response:
        opening = response.read(count=1)
        agent.gate.set()
        live = opening + response.read()
    second = api.wait_stored(second_id)
    assert as_stored(live) == second
    assert opening[0].data["run_id"] == second_id
    assert opening[0].id > first[-1]["id"]

    # No run active: the latest run, from its first event, again.
    with api.stream(conv) as response:
        assert as_stored(response.read()) == second


@BUSES
def test_a_reconnect_at_the_latest_done_with_no_run_active_gets_204(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=5))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    first = api.wait_stored(api.start_run(conv, "first"))
    second = api.wait_stored(api.start_run(conv, "second"))

    for params in (
        {"last_event_id": second[-1]["id"]},
        {"after": second[-1]["id"]},
        {"last_event_id": "99999999999999-0"},  # past every event: nothing more either
    ):
        with api.stream(conv, **params) as response:
            assert response.status_code == 204
            assert response.response.read() == b""

    # At an earlier run's done the next run is still to come.
    with api.stream(conv, last_event_id=first[-1]["id"]) as response:
        assert as_stored(response.read()) == second

    # At the latest done while a new run is active: the new run's events, not 204.
    agent.close_gate()
    third_id = api.start_run(conv, "third")
    with api.stream(conv, last_event_id=second[-1]["id"]) as response:
        assert response.status_code == 200
        opening = response.read(count=1)
        agent.gate.set()
        live = opening + response.read()
    assert as_stored(live) == api.wait_stored(third_id)


@STACKS
def test_a_stream_opened_before_the_first_run_waits_for_it_and_delivers_it(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    """A client may subscribe before it starts the conversation's first run: not a 204, which
    would stop an EventSource for good, but an open stream that gets the run when it comes."""
    agent = gated_llm.play(GatedAgent(tokens=5))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()

    with api.stream(conv) as stream:
        assert stream.status_code == 200
        run_id = api.start_run(conv)
        events = stream.read(until=lambda e: e.event == "done")

    assert events[-1].data["run_id"] == run_id and events[-1].data["answer"] == agent.answer
    assert as_stored(events) == api.wait_stored(run_id)


@pytest.mark.redis
@pytest.mark.parametrize("database_backend", ["sqlite"])
def test_a_reconnect_between_a_runs_close_and_its_done_waits_for_the_done_rather_than_204(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
    redis_prefix: str,
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=5))
    api = clients(start_service().base_url)
    conv = api.create_conversation()
    agent.close_gate()
    run_id = api.start_run(conv)
    with api.stream(conv) as stream:
        seen = stream.read(until=thinking)

    # Another worker closes the run (a reaper, say): the row first, the done event a moment later.
    async def publish_done() -> None:
        db = Database(migrated_database_url)
        bus = RedisEventBus(REDIS_URL, redis_prefix)
        try:
            publisher = RunPublisher(bus, EventRepo(db.sessionmaker), conv, run_id, last_id=seen[-1].id)
            await publisher.publish(
                RunDone(
                    answer="",
                    iterations=1,
                    usage=Usage().as_dict(),
                    elapsed=1.0,
                    status="failed",
                    error="lost",
                    pending_injections=(),
                )
            )
            await publisher.close()
        finally:
            await bus.close()
            await db.dispose()

    assert close_run_elsewhere(migrated_database_url, run_id, "lost")
    with api.stream(conv, last_event_id=seen[-1].id) as stream:
        # A 204 here would stop an EventSource for good, one event short of the done.
        assert stream.status_code == 200
        run_in_own_loop(publish_done)
        rest = stream.read()
    assert [e.event for e in rest] == ["done"]
    assert rest[0].data["status"] == "failed"


def hold_the_first_close(
    monkeypatch: pytest.MonkeyPatch, *, committed: bool
) -> tuple[threading.Event, threading.Event]:
    """Make the service's first ``RunRepo.finish`` wait for ``release`` (set ``reached`` then),
    just before its transaction or, with ``committed``, just after it. Returns (reached, release)."""
    reached, release = threading.Event(), threading.Event()
    finish = RunRepo.finish

    async def held(self: RunRepo, run_id: str, **kwargs: Any) -> bool:
        first = not reached.is_set()
        if first and not committed:
            reached.set()
            await asyncio.to_thread(release.wait, 10)
        result = await finish(self, run_id, **kwargs)
        if first and committed:
            reached.set()
            await asyncio.to_thread(release.wait, 10)
        return result

    monkeypatch.setattr(RunRepo, "finish", held)
    return reached, release


@STACKS
def test_a_run_started_between_the_previous_runs_close_and_its_done_streams_only_its_own_events(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client polling the run's status may start the next run the moment the first run's row is
    closed, before that run's done has reached the bus. The new run's stream starts after that
    done: it must not end at it, and the done must not land among the new run's events."""
    agent = gated_llm.play(GatedAgent(tokens=30, delay_s=0.01))
    closed, release = hold_the_first_close(monkeypatch, committed=True)  # its done waits
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    first = api.start_run(conv, "one")
    try:
        assert closed.wait(10), "the first run never closed"
        assert api.run(first)["status"] == "completed"
        second = api.start_run(conv, "two")
        with api.stream(conv) as stream:
            release.set()
            received = stream.read(until=lambda e: e.event == "done")
    finally:
        release.set()

    assert {e.data["run_id"] for e in received} == {second}
    assert received[-1].event == "done" and received[-1].data["answer"] == agent.answer
    assert as_stored(received) == api.wait_stored(second)
    first_events = api.wait_stored(first)
    assert first_events[-1]["event"] == "done" and first_events[-1]["data"]["answer"] == agent.answer


@STACKS
def test_a_follow_up_accepted_while_a_run_closes_reaches_the_next_run(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run has taken its last follow-ups and is closing; a follow-up posted now still finds it
    running (202), too late for it and for its done: the next run of the conversation gets it, in
    its history (before its question), once."""
    agent = gated_llm.play(GatedAgent(tokens=5))
    closing, release = hold_the_first_close(monkeypatch, committed=False)
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    first = api.start_run(conv, "one")
    try:
        assert closing.wait(10), "the first run never reached its close"
        late = api.interrupt(conv, "one more thing")
    finally:
        release.set()
    assert (late.status_code, late.json()) == (202, {"queued": 1})
    assert api.wait_finished(first)["status"] == "completed"
    assert api.wait_stored(first)[-1]["data"]["pending_injections"] == []

    asked_before = len(agent.requests)
    second = api.start_run(conv, "two")
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    assert events[-1].data["run_id"] == second
    assert [e for e in events if e.event == "inject"] == []
    second_asks = agent.requests[asked_before:]
    contents = [str(m.get("content")) for m in second_asks[0]["messages"]]
    assert "one more thing" in contents and contents.index("one more thing") < contents.index("two")
    stored = [m["content"] for m in api.http.get(f"/api/conversations/{conv}").json()["messages"]]
    assert stored.count("one more thing") == 1
