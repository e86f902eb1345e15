"""Leases: the reaper closes a run whose worker is gone (its done names the follow-ups the run never
took, and they stay in the conversation, even when the first attempt to close fails); a worker's
heartbeat never takes its own new run for one another worker closed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from app.db.errors import EventIdTakenError
from app.db.repositories import RunRepo
from app.db.session import Database
from app.streaming.bus import StoredEvent
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    GatedAgent,
    clients_fixture,
    close_run_elsewhere,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(30)

LEASE_S = 2.0
"""The lost run's lease: time enough to queue follow-ups before the reaper may close it."""


def leave_a_run_of_a_dead_worker(database_url: str, conversation_id: str) -> str:
    async def start() -> str:
        db = Database(database_url)
        try:
            async with db.engine.connect() as conn:
                owner = (
                    await conn.execute(
                        text("SELECT owner FROM conversations WHERE id = :id"), {"id": conversation_id}
                    )
                ).scalar_one()
            run, _ = await RunRepo(db.sessionmaker).start(
                conversation_id, owner, "a question", worker_id="dead", lease_s=LEASE_S, start_cursor="0-0"
            )
            return run.id
        finally:
            await db.dispose()

    return run_in_own_loop(start)


BUSES = [pytest.param(False, id="memory"), pytest.param(True, id="redis", marks=pytest.mark.redis)]


@pytest.mark.parametrize("redis_bus", BUSES)
def test_a_lost_runs_done_names_its_untaken_follow_ups_even_after_a_failed_close(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    finish = RunRepo.finish
    failures: list[str] = []

    async def finish_failing_once(self: RunRepo, run_id: str, **kwargs: Any) -> bool:
        if not failures:
            failures.append(run_id)
            raise ConnectionError("the database went away for a moment")
        return await finish(self, run_id, **kwargs)

    monkeypatch.setattr(RunRepo, "finish", finish_failing_once)
    api = clients(start_service(redis=redis_bus, run_lease_s=0.4).base_url)
    conv = api.create_conversation()
    run_id = leave_a_run_of_a_dead_worker(migrated_database_url, conv)

    queued = [api.interrupt(conv, note) for note in ("also this", "and that")]
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    assert [(r.status_code, r.json()) for r in queued] == [(202, {"queued": 1}), (202, {"queued": 2})]
    assert failures == [run_id]  # the first close failed, a later pass closed it
    done = events[-1].data
    assert (events[-1].event, done["run_id"], done["status"]) == ("done", run_id, "failed")
    assert done["pending_injections"] == ["also this", "and that"]
    assert api.run(run_id)["status"] == "failed"
    contents = [m["content"] for m in api.http.get(f"/api/conversations/{conv}").json()["messages"]]
    for note in ("also this", "and that"):
        assert sum(note in str(content) for content in contents) == 1


def test_a_run_started_during_the_heartbeats_lease_check_is_not_taken_for_lost(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat lists the worker's running runs, then compares: a run whose row was committed
    after that list was read must not be cancelled as closed by another worker."""
    agent = gated_llm.play(GatedAgent(tokens=3))
    agent.close_gate()
    listed, release = threading.Event(), threading.Event()
    running_of_worker = RunRepo.running_of_worker

    async def list_then_hold(self: RunRepo, worker_id: str) -> list[Any]:
        runs = await running_of_worker(self, worker_id)
        if not listed.is_set():
            listed.set()
            await asyncio.to_thread(release.wait, 10)
        return runs

    monkeypatch.setattr(RunRepo, "running_of_worker", list_then_hold)
    api = clients(start_service(redis=False, run_lease_s=0.3).base_url)
    first_conv, second_conv = api.create_conversation(), api.create_conversation()
    first = api.start_run(first_conv)  # the heartbeat only runs while a run is active
    try:
        assert listed.wait(10), "the heartbeat never checked its leases"
        second = api.start_run(second_conv)  # committed after the list was read
    finally:
        release.set()
    agent.gate.set()

    assert api.wait_finished(first)["status"] == "completed"
    assert api.wait_finished(second)["status"] == "completed"


def test_a_run_another_worker_closed_is_stopped_here_and_the_other_close_stands(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
) -> None:
    """This worker stalled past the lease and another closed the run with its own done: the
    heartbeat stops the run here and the other close stands. (That nothing the run still had
    queued is sent after that done is ``RunPublisher.discard``'s unit test: here the run waits in
    an LLM call, with nothing queued.)"""
    agent = gated_llm.play(GatedAgent(tokens=3))
    agent.close_gate()  # the run waits in its first LLM call
    api = clients(start_service(redis=False, run_lease_s=0.3).base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv)
    with api.stream(conv) as stream:
        seen = stream.read(count=1)

    done = StoredEvent(f"{time.time_ns() // 1_000_000 + 1}-0", "done", '{"status":"failed"}', run_id)
    assert close_run_elsewhere(
        migrated_database_url, run_id, "closed elsewhere", conversation_id=conv, done=done
    )
    wait_until(lambda: "agentstream_active_runs 0.0" in api.http.get("/metrics").text, timeout=10)
    agent.gate.set()

    events = api.events(run_id)
    assert seen and events[-1]["event"] == "done" and events[-1]["data"]["status"] == "failed"
    assert api.run(run_id)["error"] == "closed elsewhere"


def test_a_done_whose_id_was_taken_is_stamped_again_and_the_run_closes(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=3))
    finish = RunRepo.finish
    refused: list[str] = []

    async def taken_once(self: RunRepo, run_id: str, **kwargs: Any) -> bool:
        done = kwargs.get("done")
        if done is not None and not refused:
            refused.append(done.id)
            raise EventIdTakenError(done.id)  # as if another process stored an event under it
        return await finish(self, run_id, **kwargs)

    monkeypatch.setattr(RunRepo, "finish", taken_once)
    api = clients(start_service(redis=False).base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv)

    assert api.wait_finished(run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    assert events[-1]["data"]["answer"] == agent.answer
    assert refused and events[-1]["id"] != refused[0]


def test_a_reaper_close_that_went_through_despite_an_error_does_not_put_follow_ups_back(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The close committed but its answer was lost: the follow-ups are in the conversation (with
    the close); put back as well, the next run would get them a second time."""
    finish = RunRepo.finish
    answered: list[bool] = []

    async def answer_lost_once(self: RunRepo, run_id: str, **kwargs: Any) -> bool:
        result = await finish(self, run_id, **kwargs)
        if not answered:
            answered.append(result)
            raise ConnectionError("the connection broke after the commit")
        return result

    monkeypatch.setattr(RunRepo, "finish", answer_lost_once)
    agent = gated_llm.play(GatedAgent(tokens=3))
    api = clients(start_service(redis=False, run_lease_s=0.4).base_url)
    conv = api.create_conversation()
    lost = leave_a_run_of_a_dead_worker(migrated_database_url, conv)
    assert api.interrupt(conv, "only once").status_code == 202

    assert api.wait_finished(lost)["status"] == "failed"
    assert answered == [True]
    second = api.start_run(conv)
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    assert events[-1].data["run_id"] == second and events[-1].data["answer"] == agent.answer
    assert [e for e in events if e.event == "inject"] == []  # not handed to the next run again
    contents = [str(m["content"]) for m in api.http.get(f"/api/conversations/{conv}").json()["messages"]]
    assert sum("only once" in c for c in contents) == 1
