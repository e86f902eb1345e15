"""Leases and takeovers in one service (RUNS.md R-03, R-07, R-11): a run left ``running`` by a worker
that is gone is carried on here, with the follow-ups posted meanwhile; one whose attempts keep dying
is closed as failed with its done naming them; a worker's heartbeat never takes its own new run for
one another worker holds; a run another worker closed is stopped here; a run that cannot be taken
over keeps no other from it, one whose checkpoints cannot be read fails; shutdown lets go of a run
held here with no attempt."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from sqlalchemy import text

from app.db.errors import EventIdTakenError
from app.db.repositories import EventRepo, RunRecord, RunRepo
from app.db.session import Database
from app.streaming.bus import StoredEvent
from app.streaming.store import CheckpointRecord
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    GatedAgent,
    answer_of,
    clients_fixture,
    close_run_elsewhere,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(30)

LEASE_S = 1.0
"""The lost run's lease: time enough to queue follow-ups before another worker may take it."""
SERVICE_LEASE_S = 1.5
"""The service's own: its claim loop looks every half second."""


def leave_a_run_of_a_dead_worker(
    database_url: str, conversation_id: str, question: str = "a question"
) -> str:
    """A run ``running`` on a worker of another host that is gone: its lease runs out in LEASE_S."""

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
                conversation_id,
                owner,
                question,
                worker_id="elsewhere:1:dead",
                lease_s=LEASE_S,
                start_cursor="0-0",
            )
            return run.id
        finally:
            await db.dispose()

    return run_in_own_loop(start)


BUSES = [pytest.param(False, id="memory"), pytest.param(True, id="redis", marks=pytest.mark.redis)]


@pytest.mark.parametrize("redis_bus", BUSES)
def test_a_run_left_by_a_dead_worker_is_carried_on_here_with_the_follow_ups_posted_meanwhile(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=6))
    api = clients(start_service(redis=redis_bus, run_lease_s=SERVICE_LEASE_S).base_url)
    conv = api.create_conversation()
    run_id = leave_a_run_of_a_dead_worker(migrated_database_url, conv, "what was asked")

    queued = [api.interrupt(conv, note) for note in ("also this", "and that")]
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    assert [(r.status_code, r.json()) for r in queued] == [(202, {"queued": 1}), (202, {"queued": 2})]
    resumed = [e.data for e in events if e.event == "phase" and e.data.get("phase") == "resumed"]
    assert resumed == [{"phase": "resumed", "attempt": 2, "after": "0-0", "run_id": run_id}]
    done = events[-1].data
    assert (events[-1].event, done["run_id"], done["status"]) == ("done", run_id, "completed")
    assert done["answer"] == agent.answer == answer_of([{"event": e.event, "data": e.data} for e in events])
    assert [e.data["content"] for e in events if e.event == "inject"] == ["also this\nand that"]
    assert agent.saw("what was asked") and agent.saw("also this")
    run = api.run(run_id)
    assert (run["status"], run["attempt"]) == ("completed", 2)
    contents = [m["content"] for m in api.http.get(f"/api/conversations/{conv}").json()["messages"]]
    for note in ("also this", "and that"):
        assert sum(note in str(content) for content in contents) == 1
    metrics = api.http.get("/metrics").text
    assert 'agentstream_runs_resumed_total{cause="lost"} 1.0' in metrics
    assert "agentstream_run_attempts_total 1.0" in metrics  # this process ran one attempt: the 2nd
    (written,) = [line for line in metrics.splitlines() if line.startswith("agentstream_checkpoints_total")]
    assert float(written.split()[1]) >= 3  # a reply, its end of iteration, the loop's outcome
    assert "agentstream_run_handovers_total 0.0" in metrics


def test_a_run_whose_attempts_keep_dying_fails_naming_its_untaken_follow_ups_even_after_a_failed_close(
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
    # One attempt may die: this run's first worker died, so it is not carried on.
    api = clients(start_service(redis=False, run_max_attempts=1, run_lease_s=SERVICE_LEASE_S).base_url)
    conv = api.create_conversation()
    run_id = leave_a_run_of_a_dead_worker(migrated_database_url, conv)

    queued = [api.interrupt(conv, note) for note in ("also this", "and that")]
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    assert [r.status_code for r in queued] == [202, 202]
    assert failures == [run_id]  # the first close failed; the run was let go and closed again
    done = events[-1].data
    assert (events[-1].event, done["run_id"], done["status"]) == ("done", run_id, "failed")
    assert "lost 1 times" in done["error"] and "RUN_MAX_ATTEMPTS=1" in done["error"]
    assert done["pending_injections"] == ["also this", "and that"]
    assert api.run(run_id)["status"] == "failed"
    contents = [m["content"] for m in api.http.get(f"/api/conversations/{conv}").json()["messages"]]
    for note in ("also this", "and that"):
        assert sum(note in str(content) for content in contents) == 1
    # The next run of the conversation does not get them a second time.
    second = api.start_run(conv)
    with api.stream(conv) as stream:
        later = stream.read(until=lambda e: e.event == "done")
    assert later[-1].data["run_id"] == second and [e for e in later if e.event == "inject"] == []


def test_a_run_started_during_the_heartbeats_lease_check_is_not_taken_for_lost(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat lists the worker's running runs, then compares: a run whose row was committed
    after that list was read must not be cancelled as taken over by another worker."""
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


def leave_checkpoint(database_url: str, conversation_id: str, run_id: str, delta: dict[str, Any]) -> None:
    """A checkpoint of the dead worker's attempt (what its engine stored before it died)."""

    async def save() -> None:
        db = Database(database_url)
        try:
            record = CheckpointRecord(run_id, 1, 0, orjson.dumps(delta).decode(), after=None)
            await EventRepo(db.sessionmaker).save(conversation_id, [], [record])
        finally:
            await db.dispose()

    run_in_own_loop(save)


def test_usage_adds_up_every_attempt(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
) -> None:
    """R-06: what the lost attempt's calls cost (its checkpoint says so) and every call of the new one."""
    agent = gated_llm.play(GatedAgent(tokens=4))
    api = clients(start_service(redis=False, run_lease_s=SERVICE_LEASE_S).base_url)
    conv = api.create_conversation()
    run_id = leave_a_run_of_a_dead_worker(migrated_database_url, conv)
    leave_checkpoint(
        migrated_database_url, conv, run_id, {"v": [0, 0, False, 0, False, 0, 100, 20, 120, 3, None]}
    )

    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    calls = len(agent.requests)
    assert calls >= 2  # the loop's call and the synthesis, at least
    usage = events[-1].data["usage"]
    assert usage == {
        "prompt_tokens": 100 + 10 * calls,
        "completion_tokens": 20 + 5 * calls,
        "total_tokens": 120 + 15 * calls,
        "llm_calls": 3 + calls,
    }
    assert api.run(run_id)["usage"] == usage


def test_a_run_cancelled_while_no_worker_holds_it_ends_cancelled_when_it_is_taken_over(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
) -> None:
    """R-11: its worker is gone and its lease still runs: the cancel is kept on the run, and the
    worker that takes it over closes it, with its done, instead of carrying it on."""
    agent = gated_llm.play(GatedAgent(tokens=4))
    api = clients(start_service(redis=False, run_lease_s=SERVICE_LEASE_S).base_url)
    conv = api.create_conversation()
    run_id = leave_a_run_of_a_dead_worker(migrated_database_url, conv)

    cancelled = api.cancel(conv)
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "done")

    assert cancelled.status_code == 202, cancelled.text
    done = events[-1].data
    assert (done["run_id"], done["status"], done["error"]) == (run_id, "cancelled", "cancelled by the user")
    assert agent.requests == []  # not carried on: no model call
    assert api.run(run_id)["status"] == "cancelled"
    assert api.cancel(conv).status_code == 409


def stored_run(database_url: str, run_id: str) -> RunRecord:
    """The run's row as stored now."""

    async def read() -> RunRecord:
        db = Database(database_url)
        try:
            run = await RunRepo(db.sessionmaker).get_any(run_id)
            assert run is not None
            return run
        finally:
            await db.dispose()

    return run_in_own_loop(read)


def test_a_run_that_cannot_be_taken_over_does_not_keep_the_others_from_being_taken_over(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first run the claim loop finds breaks every attempt to carry it on (here its history
    cannot be read): the loop goes on to the next run, and each failed take-over lets the broken
    run go as a lost attempt (R-07), so that it cannot go on failing for ever."""
    agent = gated_llm.play(GatedAgent(tokens=3))
    broken: list[str] = []
    history_before = RunRepo.history_before

    async def history_failing_for_the_broken_run(self: RunRepo, run: RunRecord) -> list[Any]:
        if run.id in broken:
            raise RuntimeError("this run's history cannot be read")
        return await history_before(self, run)

    monkeypatch.setattr(RunRepo, "history_before", history_failing_for_the_broken_run)
    api = clients(start_service(redis=False, run_lease_s=SERVICE_LEASE_S, run_max_attempts=100).base_url)
    broken_conv, good_conv = api.create_conversation(), api.create_conversation()
    # Left first, so every pass of the claim loop finds it first.
    broken.append(leave_a_run_of_a_dead_worker(migrated_database_url, broken_conv))
    good = leave_a_run_of_a_dead_worker(migrated_database_url, good_conv)

    assert api.wait_finished(good)["status"] == "completed"
    done = api.wait_stored(good)[-1]["data"]
    assert (done["status"], done["answer"]) == ("completed", agent.answer)
    # The broken run was claimed again and again, each failed attempt counted as lost.
    run = wait_until(
        lambda: (r := stored_run(migrated_database_url, broken[0])).lost_attempts >= 3 and r,
        timeout=15,
        what="the broken run's failed take-overs to be counted",
    )
    assert run.status == "running" and run.attempt >= 3
    assert run.lost_attempts == run.attempt or run.lost_attempts == run.attempt - 1
    assert api.events(broken[0]) == []


def test_a_run_whose_checkpoints_cannot_be_read_is_closed_failed_with_its_done(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=3))
    api = clients(start_service(redis=False, run_lease_s=SERVICE_LEASE_S).base_url)
    conv = api.create_conversation()
    run_id = leave_a_run_of_a_dead_worker(migrated_database_url, conv)

    async def save_garbage() -> None:
        db = Database(migrated_database_url)
        try:
            record = CheckpointRecord(run_id, 1, 0, "not json", after=None)
            await EventRepo(db.sessionmaker).save(conv, [], [record])
        finally:
            await db.dispose()

    run_in_own_loop(save_garbage)

    run = api.wait_finished(run_id)
    assert run["status"] == "failed"
    assert "its checkpoints could not be read" in run["error"]
    stored = api.wait_stored(run_id)
    assert [e["event"] for e in stored] == ["done"]
    done = stored[-1]["data"]
    assert (done["run_id"], done["status"], done["error"]) == (run_id, "failed", run["error"])
    assert agent.requests == []  # not carried on: no model call
    with api.stream(conv) as stream:  # and a client that follows the conversation gets that done
        assert stream.read(until=lambda e: e.event == "done")[-1].data == done


def test_shutdown_releases_a_run_this_worker_holds_with_no_attempt_at_work(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    migrated_database_url: str,
) -> None:
    """A claim cut short by the shutdown (the row says this worker holds the run, no attempt of it
    works here): another worker may take it at once, not after its lease."""
    server = start_service(redis=False)
    api = clients(server.base_url)
    conv = api.create_conversation()
    worker_id = server.services.manager.worker_id

    async def hold_a_run() -> str:
        db = Database(migrated_database_url)
        try:
            async with db.engine.connect() as conn:
                owner = (
                    await conn.execute(text("SELECT owner FROM conversations WHERE id = :id"), {"id": conv})
                ).scalar_one()
            run, _ = await RunRepo(db.sessionmaker).start(
                conv, owner, "q", worker_id=worker_id, lease_s=300, start_cursor="0-0"
            )
            return run.id
        finally:
            await db.dispose()

    run_id = run_in_own_loop(hold_a_run)
    held = stored_run(migrated_database_url, run_id)
    assert (held.status, held.worker_id) == ("running", worker_id)

    server.stop()

    released = stored_run(migrated_database_url, run_id)
    assert (released.status, released.worker_id, released.lease_expires_at) == ("running", None, None)
    assert released.attempt == 1 and released.lost_attempts == 0
