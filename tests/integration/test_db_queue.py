"""The run queue in the database (RUNS.md Q-01, Q-02) against real SQLite and PostgreSQL: a start
runs or queues as its worker's room, its owner's cap and the runs already queued say; a full
queue refuses and stores nothing; queued runs are taken oldest first, each by one worker, never
past an owner's cap (also when workers take at once), and a queued run can be cancelled."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from app.db.errors import QueueFullError
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.queue import Admission, RunQueue
from app.db.session import Database
from app.engine.events import RunQueued
from app.streaming.bus import StoredEvent
from app.streaming.publisher import stamp_after


@pytest.fixture
def runs(database: Database) -> RunRepo:
    return RunRepo(database.sessionmaker)


@pytest.fixture
def queue(database: Database) -> RunQueue:
    return RunQueue(database.sessionmaker)


def queued_phase(run_id: str, after: str, position: int) -> StoredEvent:
    return stamp_after(RunQueued(position), run_id, after)


async def position(database: Database, run: RunRecord) -> int:
    """The position the run's ``queued`` phase announced."""
    (event,) = await EventRepo(database.sessionmaker).for_run(run.id)
    return int(orjson.loads(event.data)["position"])


async def start(
    database: Database,
    runs: RunRepo,
    owner: str = "alice",
    *,
    room: bool,
    per_owner: int | None = None,
    max_queued: int = 100,
    message: str = "q",
) -> RunRecord:
    """A run started in a new conversation of ``owner`` by worker ``w0``."""
    conv = await ConversationRepo(database.sessionmaker).create(owner, "queue", {})
    return await start_in(runs, conv, room=room, per_owner=per_owner, max_queued=max_queued, message=message)


async def start_in(
    runs: RunRepo,
    conv: ConversationRecord,
    *,
    room: bool,
    per_owner: int | None = None,
    max_queued: int = 100,
    message: str = "q",
) -> RunRecord:
    run, _ = await runs.start(
        conv.id,
        conv.owner,
        message,
        worker_id="w0",
        lease_s=30,
        start_cursor="0-0",
        admission=Admission(room, per_owner, max_queued),
        queued_event=queued_phase,
    )
    return run


async def test_a_start_with_room_runs_and_one_without_queues_with_its_question_and_phase_stored(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    running = await start(database, runs, room=True)
    queued = await start(database, runs, room=False, message="wait for me")

    assert (running.status, running.worker_id, running.attempt) == ("running", "w0", 1)
    assert (queued.status, queued.worker_id, queued.lease_expires_at, queued.attempt) == (
        "queued",
        None,
        None,
        1,
    )
    stored = await runs.get_any(queued.id)
    assert stored is not None and stored.status == "queued"
    messages = await ConversationRepo(database.sessionmaker).messages(queued.conversation_id)
    assert [(m.role, m.content, m.run_id) for m in messages] == [("user", "wait for me", queued.id)]
    events = await EventRepo(database.sessionmaker).for_run(queued.id)
    assert [(e.event, orjson.loads(e.data)) for e in events] == [
        ("phase", {"phase": "queued", "position": 1, "run_id": queued.id})
    ]
    assert await queue.length() == 1


async def test_a_start_with_room_queues_behind_runs_that_queue_already(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    first = await start(database, runs, room=False)
    second = await start(database, runs, room=True)

    assert (first.status, second.status) == ("queued", "queued")
    assert [await position(database, first), await position(database, second)] == [1, 2]
    assert [r.id for r in await queue.next(10)] == [first.id, second.id]


async def test_a_full_queue_refuses_a_start_and_stores_nothing_of_it(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    waiting = await start(database, runs, room=False, max_queued=1)
    conv = await ConversationRepo(database.sessionmaker).create("alice", "refused", {})

    with pytest.raises(QueueFullError):
        await start_in(runs, conv, room=False, max_queued=1)

    assert await runs.latest(conv.id) is None
    assert await ConversationRepo(database.sessionmaker).messages(conv.id) == []
    assert await EventRepo(database.sessionmaker).last_id(conv.id) is None
    assert await queue.length() == 1
    # With room, it would still queue behind the one waiting: refused too, until that one starts.
    with pytest.raises(QueueFullError):
        await start_in(runs, conv, room=True, max_queued=1)
    assert await queue.take(waiting, "w1", 30) is not None
    assert (await start_in(runs, conv, room=True, max_queued=1)).status == "running"


async def test_concurrent_starts_never_queue_more_than_the_bound(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    outcomes = await asyncio.gather(
        *(start(database, runs, f"owner{i}", room=False, max_queued=3) for i in range(8)),
        return_exceptions=True,
    )

    refused = [o for o in outcomes if isinstance(o, QueueFullError)]
    queued = [o for o in outcomes if isinstance(o, RunRecord)]
    assert (len(queued), len(refused)) == (3, 5), outcomes
    assert await queue.length() == 3


async def test_queued_runs_are_taken_oldest_first_each_by_exactly_one_worker(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    queued = [await start(database, runs, room=False) for _ in range(3)]
    assert [r.id for r in await queue.next(10)] == [r.id for r in queued]
    assert [r.id for r in await queue.next(2)] == [r.id for r in queued[:2]]

    taken = await asyncio.gather(*(queue.take(queued[0], f"w{i}", 30) for i in range(1, 5)))

    winners = [t for t in taken if t is not None]
    assert len(winners) == 1
    winner = winners[0]
    assert (winner.status, winner.attempt, winner.lease_expires_at is not None) == ("running", 1, True)
    assert winner.worker_id in {"w1", "w2", "w3", "w4"}
    assert [r.id for r in await queue.next(10)] == [r.id for r in queued[1:]]


async def test_an_owner_at_its_cap_queues_without_holding_up_other_owners(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    alice_running = await start(database, runs, "alice", room=True, per_owner=1)
    alice_waits = await start(database, runs, "alice", room=True, per_owner=1)
    bob = await start(database, runs, "bob", room=True, per_owner=1)

    assert (alice_running.status, alice_waits.status, bob.status) == ("running", "queued", "running")
    # Alice's queued run waits for her, not for room: no worker takes it while she is at her cap.
    assert await queue.next(10, per_owner=1) == []
    assert await queue.take(alice_waits, "w1", 30, per_owner=1) is None
    assert (await runs.get_any(alice_waits.id)).status == "queued"  # type: ignore[union-attr]

    await runs.finish(
        alice_running.id,
        status="completed",
        answer="a",
        iterations=1,
        usage={},
        elapsed=0.1,
        error=None,
        pending_injections=[],
    )
    assert [r.id for r in await queue.next(10, per_owner=1)] == [alice_waits.id]
    taken = await queue.take(alice_waits, "w1", 30, per_owner=1)
    assert taken is not None and taken.status == "running"


async def test_a_new_run_of_an_owner_back_under_its_cap_queues_behind_that_owners_queued_runs(
    database: Database, runs: RunRepo
) -> None:
    first = await start(database, runs, "alice", room=True, per_owner=1)
    second = await start(database, runs, "alice", room=True, per_owner=1)
    await runs.finish(
        first.id, status="completed", answer="a", iterations=1, usage={}, elapsed=0.1, error=None,
        pending_injections=[],
    )  # fmt: skip

    third = await start(database, runs, "alice", room=True, per_owner=1)

    assert (second.status, third.status) == ("queued", "queued")


async def test_workers_taking_one_owners_runs_at_once_never_pass_its_cap(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    queued = [await start(database, runs, "alice", room=False, per_owner=2) for _ in range(5)]

    taken = await asyncio.gather(*(queue.take(run, f"w{i}", 30, per_owner=2) for i, run in enumerate(queued)))

    assert len([t for t in taken if t is not None]) == 2
    counts = await runs.counts_by_status()
    assert (counts["running"], counts["queued"]) == (2, 3)


async def test_a_cancelled_queued_run_is_left_for_a_claim_to_close(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    queued = await start(database, runs, room=False)

    assert await runs.request_cancel(queued.id)

    run = await runs.get_any(queued.id)
    assert run is not None
    assert (run.status, run.worker_id, run.cancel_requested) == ("running", None, True)
    assert [r.id for r in await runs.claimable("w1")] == [queued.id]
    claimed = await runs.claim(run, "w1", 30, lost=False)
    assert claimed is not None and claimed.attempt == 1  # never started: the closing claim is its first
    assert await queue.take(queued, "w2", 30) is None  # no longer queued
    assert await queue.length() == 0
