"""The run queue in the database (RUNS.md Q-01, Q-02) against real SQLite and PostgreSQL: a start
runs or queues as its worker's room, its owner's cap and the runs already queued say; a full
queue refuses and stores nothing; queued runs are taken oldest first, each by one worker, never
past an owner's cap (also when workers take at once), and a queued run can be cancelled."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from sqlalchemy import func, select, text, update

from app.db.errors import QueueFullError
from app.db.models import Run, utcnow
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.queue import QUEUE_LOCK, Admission, RunQueue
from app.db.session import Database
from app.engine.events import RunQueued
from app.streaming.bus import StoredEvent
from app.streaming.stamp import stamp_after
from tests.support.server import async_wait_until


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


async def waiting_for_a_lock(database: Database) -> bool:
    """Whether some session of the PostgreSQL server waits for a lock."""
    async with database.sessionmaker() as session:
        return bool(
            await session.scalar(
                select(func.count()).select_from(text("pg_locks")).where(text("NOT granted"))
            )
        )


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
    assert [r.id for r in await queue.take_next(10, "w1", 30)] == [first.id, second.id]


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
    assert [r.id for r in await queue.take_next(5, "w1", 30)] == [waiting.id]
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


async def test_queued_starts_far_from_the_bound_do_not_wait_for_each_other_but_one_near_it_does(
    database: Database, runs: RunRepo, queue: RunQueue, database_backend: str
) -> None:
    if database_backend != "postgres":
        pytest.skip("SQLite has one writer at a time: starts wait for each other there anyway")

    async with database.sessionmaker.begin() as other:
        # A queued start far from the bound, not yet committed: it holds the queue's lock shared.
        await other.execute(select(func.pg_advisory_xact_lock_shared(QUEUE_LOCK, func.hashtext(""))))

        far = await asyncio.wait_for(start(database, runs, room=False, max_queued=100_000), timeout=10)

        assert far.status == "queued"
        # Near the bound (within the server's max_connections of it) a start counts alone.
        near = asyncio.create_task(start(database, runs, room=False, max_queued=5))
        await async_wait_until(
            lambda: waiting_for_a_lock(database), what="the near start to wait for the lock"
        )
        assert not near.done()
    assert (await asyncio.wait_for(near, timeout=10)).status == "queued"
    assert await queue.length() == 2


async def test_queued_runs_are_taken_oldest_first_each_by_exactly_one_worker(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    queued = [await start(database, runs, room=False) for _ in range(5)]

    first = await queue.take_next(2, "w1", 30)

    assert [r.id for r in first] == [r.id for r in queued[:2]]
    for run in first:
        assert (run.status, run.worker_id, run.attempt, run.lease_expires_at is not None) == (
            "running",
            "w1",
            1,
            True,
        )
    # Four workers with room for two each, at once: the three left are taken, each by one of them.
    batches = await asyncio.gather(*(queue.take_next(2, f"w{i}", 30) for i in range(2, 6)))
    taken = [run.id for batch in batches for run in batch]
    assert sorted(taken) == sorted(r.id for r in queued[2:])
    assert await queue.length() == 0
    assert await queue.take_next(2, "w6", 30) == []


async def test_waiting_counts_the_queued_runs_a_worker_could_take_now(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    await start(database, runs, "alice", room=True, per_owner=1)
    await start(database, runs, "alice", room=True, per_owner=1)  # queued: alice is at her cap
    await start(database, runs, "bob", room=False, per_owner=1)
    await start(database, runs, "carol", room=False, per_owner=1)

    assert await queue.waiting(10) == 3
    assert await queue.waiting(2) == 2
    assert await queue.waiting(10, per_owner=1) == 2  # not alice's
    await queue.take_next(10, "w1", 30, per_owner=1)
    assert await queue.waiting(10, per_owner=1) == 0


@pytest.mark.parametrize(
    ("before", "holder", "attempt"),
    [
        pytest.param("queued", "w1", 1, id="a-worker-taking-it-from-the-queue"),
        pytest.param("waiting", None, 2, id="a-decision-letting-it-go-on"),
    ],
)
async def test_a_cancel_that_meets_a_change_in_flight_cancels_the_run_it_became(
    database: Database, runs: RunRepo, database_backend: str, before: str, holder: str | None, attempt: int
) -> None:
    if database_backend != "postgres":
        pytest.skip("SQLite has one writer at a time: a cancel cannot meet another write in flight")
    run = await start(database, runs, room=False)
    if before == "waiting":
        async with database.sessionmaker.begin() as session:
            await session.execute(update(Run).where(Run.id == run.id).values(status="waiting", attempt=2))
    async with database.sessionmaker.begin() as change:
        # Not yet committed, holding the run's row: a worker's take of the queued run, or a
        # decision that lets the waiting run go on (running, held by nobody until claimed).
        lease = utcnow() if holder is not None else None
        await change.execute(
            update(Run)
            .where(Run.id == run.id)
            .values(status="running", worker_id=holder, lease_expires_at=lease)
        )
        cancel = asyncio.create_task(runs.request_cancel(run.id))
        await async_wait_until(lambda: waiting_for_a_lock(database), what="the cancel to wait for the row")

    assert await asyncio.wait_for(cancel, timeout=10) is True
    after = await runs.get_any(run.id)
    assert after is not None
    assert (after.status, after.worker_id, after.cancel_requested, after.attempt) == (
        "running",
        holder,
        True,
        attempt,
    )


async def test_a_worker_skips_the_queued_runs_another_one_is_taking_instead_of_waiting_for_them(
    database: Database, runs: RunRepo, queue: RunQueue, database_backend: str
) -> None:
    if database_backend != "postgres":
        pytest.skip("SQLite has one writer at a time: there is no other taker to skip")
    queued = [await start(database, runs, room=False) for _ in range(3)]
    async with database.sessionmaker.begin() as other:
        # Another worker's claim of the oldest, not yet committed.
        await other.execute(select(Run.id).where(Run.id == queued[0].id).with_for_update())

        taken = await asyncio.wait_for(queue.take_next(5, "w1", 30), timeout=10)

        assert [r.id for r in taken] == [r.id for r in queued[1:]]
    assert [r.id for r in await queue.take_next(5, "w2", 30)] == [queued[0].id]


async def test_an_owner_at_its_cap_queues_without_holding_up_other_owners(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    alice_running = await start(database, runs, "alice", room=True, per_owner=1)
    alice_waits = await start(database, runs, "alice", room=True, per_owner=1)
    bob = await start(database, runs, "bob", room=True, per_owner=1)

    assert (alice_running.status, alice_waits.status, bob.status) == ("running", "queued", "running")
    # Alice's queued run waits for her, not for room: no worker takes it while she is at her cap.
    assert await queue.take_next(10, "w1", 30, per_owner=1) == []
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
    (taken,) = await queue.take_next(10, "w1", 30, per_owner=1)
    assert (taken.id, taken.status) == (alice_waits.id, "running")


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

    batches = await asyncio.gather(*(queue.take_next(1, f"w{i}", 30, per_owner=2) for i in range(5)))

    assert len([run for batch in batches for run in batch]) == 2
    counts = await runs.counts_by_status()
    assert (counts["running"], counts["queued"]) == (2, 3)
    assert {r.id for batch in batches for r in batch} <= {r.id for r in queued}


async def test_one_batch_takes_no_more_of_an_owners_runs_than_its_cap_and_puts_the_rest_back(
    database: Database, runs: RunRepo, queue: RunQueue
) -> None:
    alice = [await start(database, runs, "alice", room=False, per_owner=2) for _ in range(4)]
    bob = await start(database, runs, "bob", room=False, per_owner=2)

    taken = await queue.take_next(10, "w1", 30, per_owner=2)

    assert [r.id for r in taken] == [alice[0].id, alice[1].id, bob.id]
    for run in alice[2:]:
        back = await runs.get_any(run.id)
        assert back is not None
        assert (back.status, back.worker_id, back.lease_expires_at) == ("queued", None, None)
    assert await queue.length() == 2


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
    assert await queue.take_next(5, "w2", 30) == []  # no longer queued
    assert await queue.length() == 0
