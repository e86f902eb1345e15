"""Claiming runs for a new attempt (RUNS.md R-03, R-07, R-08, R-11) against real SQLite and
PostgreSQL: one claim wins, the new attempt's first checkpoint is stored with it, an attempt that
lost the run can neither close it nor add to its checkpoints (nor, once its worker's leases are
unconfirmed for half a lease, any event), one that closed its run still holds it, a failed
attempt let go counts as lost, and pruning deletes only what finished runs no longer need."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from typing import Any

import orjson
import pytest
from sqlalchemy import select, update

from app.db.models import Run, ToolEffect, utcnow
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.follow_ups import FollowUpRepo
from app.db.repositories.runs import CheckpointRow
from app.db.session import Database
from app.engine.events import ThinkingStarted
from app.llm.base import ChatMessage
from app.streaming.bus import StoredEvent
from app.streaming.memory import MemoryEventBus
from app.streaming.publisher import RunPublisher
from app.streaming.store import AttemptLostError, CheckpointRecord, Fence, HoldClock


@pytest.fixture
def runs(database: Database) -> RunRepo:
    return RunRepo(database.sessionmaker)


@pytest.fixture
async def conv(database: Database) -> ConversationRecord:
    return await ConversationRepo(database.sessionmaker).create("alice", "claims", {})


async def expired_run(runs: RunRepo, conv: ConversationRecord, worker_id: str = "dead") -> RunRecord:
    """A run whose worker's lease ran out a second ago."""
    run, _ = await runs.start(conv.id, "alice", "q", worker_id=worker_id, lease_s=-1, start_cursor="0-0")
    return run


def keep_last(rows: list[CheckpointRow]) -> CheckpointRow | None:
    """A snapshot that is the last row's data (enough to see which rows the claim read)."""
    return CheckpointRow(0, rows[-1].after, rows[-1].data) if rows else None


async def claim_keeping_last(
    runs: RunRepo, run: RunRecord, worker_id: str, *, lost: bool, holder_dead: bool = False
) -> RunRecord | None:
    """A claim as the takeover makes it: the last attempt's checkpoints read first."""
    first = keep_last(await runs.checkpoints(run.id, run.attempt))
    return await runs.claim(run, worker_id, 30, lost=lost, holder_dead=holder_dead, first=first)


async def test_of_two_workers_claiming_one_run_exactly_one_wins(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    run = await expired_run(runs, conv)

    claims = await asyncio.gather(*(claim_keeping_last(runs, run, f"w{i}", lost=True) for i in range(4)))

    won = [c for c in claims if c is not None]
    assert len(won) == 1
    (claimed,) = won
    assert (claimed.attempt, claimed.lost_attempts, claimed.status) == (2, 1, "running")
    stored = await runs.get_any(run.id)
    assert stored is not None and stored.worker_id == claimed.worker_id and stored.attempt == 2
    # As read before the claim, the run is no longer claimable (another attempt holds it).
    assert await claim_keeping_last(runs, run, "late", lost=True) is None


async def test_a_held_lease_cannot_be_claimed_unless_its_holder_is_known_dead(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="alive", lease_s=300, start_cursor="0-0")
    assert await claim_keeping_last(runs, run, "w", lost=True) is None
    claimed = await claim_keeping_last(runs, run, "w", lost=True, holder_dead=True)
    assert claimed is not None and claimed.worker_id == "w"


async def test_a_released_run_is_claimed_without_counting_a_lost_attempt(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="leaving", lease_s=300, start_cursor="0-0")
    assert not await runs.release(run.id, run.attempt, "someone else")
    assert await runs.release(run.id, run.attempt, "leaving")
    released = await runs.get_any(run.id)
    assert released is not None and (released.worker_id, released.lease_expires_at) == (None, None)

    claimed = await claim_keeping_last(runs, released, "w", lost=False)

    assert claimed is not None and (claimed.attempt, claimed.lost_attempts) == (2, 0)


async def test_the_claim_stores_the_new_attempts_first_checkpoint_and_ignores_later_rows_of_the_old(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)
    run = await expired_run(runs, conv)
    for seq in range(3):
        data = orjson.dumps({"n": seq}).decode()
        await events.save(conv.id, [], [CheckpointRecord(run.id, 1, seq, data, after=f"{seq + 1}-0")])

    claimed = await claim_keeping_last(runs, run, "w", lost=True)
    assert claimed is not None
    # The old attempt goes on writing (it stalled; it does not know yet): nobody reads that.
    await events.save(conv.id, [], [CheckpointRecord(run.id, 1, 3, '{"n": 3}', after="9-0")])

    assert await runs.checkpoints(run.id, 2) == [CheckpointRow(0, "3-0", '{"n":2}')]
    assert len(await runs.checkpoints(run.id, 1)) == 4


async def test_an_attempt_that_lost_the_run_cannot_close_it(runs: RunRepo, conv: ConversationRecord) -> None:
    run = await expired_run(runs, conv)
    claimed = await claim_keeping_last(runs, run, "w", lost=True)
    assert claimed is not None

    def close(attempt: int) -> object:
        return runs.finish(
            run.id,
            status="completed",
            answer="a",
            iterations=1,
            usage={},
            elapsed=1.0,
            error=None,
            pending_injections=[],
            attempt=attempt,
        )

    assert not await close(1)
    assert await close(2)
    closed = await runs.get_any(run.id)
    assert closed is not None and closed.status == "completed"


async def test_a_cancel_asked_for_between_attempts_is_kept_on_the_run(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    run = await expired_run(runs, conv)
    assert await runs.request_cancel(run.id)
    claimed = await claim_keeping_last(runs, run, "w", lost=True)
    assert claimed is not None and claimed.cancel_requested


async def test_history_before_is_what_the_run_started_with(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    first, history = await runs.start(conv.id, "alice", "one", worker_id="w", lease_s=30, start_cursor="0-0")
    await runs.finish(
        first.id,
        status="completed",
        answer="1",
        iterations=1,
        usage={},
        elapsed=1.0,
        error=None,
        pending_injections=[],
        messages=[ChatMessage(role="assistant", content="1")],
        conversation_id=conv.id,
    )
    second, history = await runs.start(conv.id, "alice", "two", worker_id="w", lease_s=30, start_cursor="0-0")
    await conversations.add_messages(conv.id, None, [ChatMessage(role="user", content="later")])

    assert [m.content for m in await runs.history_before(second)] == [m.content for m in history]
    assert [m.content for m in history] == ["one", "1"]


async def test_an_attempt_that_lost_the_run_can_store_no_event_or_checkpoint_and_takes_no_follow_up(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)
    follow_ups = FollowUpRepo(database.sessionmaker)
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="w1", lease_s=-1, start_cursor="0-0")
    for text in ("a", "b"):
        await follow_ups.add(conv.id, text, limit=10)
    first_id = (await follow_ups.after(conv.id, 0))[0].id
    old = Fence(run.id, 1, "w1", 30)
    await events.save(conv.id, [StoredEvent("5-0", "step", "{}", run.id)], [], old)
    held = await runs.get_any(run.id)
    assert held is not None and held.lease_expires_at is not None  # the save renewed the lease

    claimed = await claim_keeping_last(runs, run, "w2", lost=True, holder_dead=True)
    assert claimed is not None
    taken = CheckpointRecord(run.id, 1, 0, "{}", after="6-0", follow_ups_through=first_id)
    with pytest.raises(AttemptLostError):
        await events.save(conv.id, [StoredEvent("6-0", "step", "{}", run.id)], [taken], old)

    assert [e.id for e in await events.for_run(run.id)] == ["5-0"]
    assert await runs.checkpoints(run.id, 1) == []
    assert [f.content for f in await follow_ups.after(conv.id, 0)] == ["a", "b"]
    # The attempt that holds the run stores, and its checkpoint takes the follow-ups it records.
    new = Fence(run.id, claimed.attempt, "w2", 30)
    taken = CheckpointRecord(run.id, claimed.attempt, 1, "{}", after="7-0", follow_ups_through=first_id)
    await events.save(conv.id, [StoredEvent("7-0", "step", "{}", run.id)], [taken], new)
    assert [f.content for f in await follow_ups.after(conv.id, 0)] == ["b"]
    assert await follow_ups.add(conv.id, "c", limit=2) == 2  # what was taken no longer counts


async def test_a_release_that_says_the_attempt_failed_counts_a_lost_attempt(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="w", lease_s=300, start_cursor="0-0")
    assert await runs.release(run.id, run.attempt, "w", lost=True)
    released = await runs.get_any(run.id)
    assert released is not None and (released.worker_id, released.lost_attempts) == (None, 1)

    # Claimed from a release, the new attempt adds no lost attempt of its own; the count stays.
    claimed = await claim_keeping_last(runs, released, "w2", lost=False)
    assert claimed is not None and (claimed.attempt, claimed.lost_attempts) == (2, 1)
    assert await runs.release(claimed.id, claimed.attempt, "w2", lost=True)
    again = await runs.get_any(run.id)
    assert again is not None and again.lost_attempts == 2


# ---- writes of a worker whose leases are unconfirmed -------------------------------------------


def stale_clock(lease_s: float) -> HoldClock:
    """The worker's heartbeat last confirmed its leases more than half a lease ago (it stalled)."""
    clock = HoldClock()
    clock.confirmed_at = time.monotonic() - lease_s / 2 - 1
    return clock


async def publish_one_step(events: EventRepo, conv: ConversationRecord, fence: Fence) -> RunPublisher:
    """An attempt's publisher, as the executor makes it, with one ordinary event and checkpoint
    (no follow-ups taken) published and stored."""
    publisher = RunPublisher(MemoryEventBus(), events, conv.id, fence.run_id, last_id=None, fence=fence)
    await publisher.publish(ThinkingStarted(1))
    publisher.checkpoint(CheckpointRecord(fence.run_id, fence.attempt, 1, '{"v":[1]}'))
    return publisher


async def test_a_stalled_attempt_whose_run_another_attempt_claimed_stores_nothing(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)
    run = await expired_run(runs, conv, worker_id="w1")
    claimed = await claim_keeping_last(runs, run, "w2", lost=True)
    assert claimed is not None

    stalled = Fence(run.id, 1, "w1", 30, hold=stale_clock(30))
    publisher = await publish_one_step(events, conv, stalled)
    with pytest.raises(AttemptLostError):
        await publisher.flush_store()
    await publisher.discard()

    assert await events.for_run(run.id) == []
    assert await runs.checkpoints(run.id, 1) == []
    held = await runs.get_any(run.id)
    assert held is not None and (held.worker_id, held.attempt) == ("w2", 2)


async def test_an_attempt_whose_leases_were_just_confirmed_stores_ordinary_writes_unfenced(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    """The documented cost saving: while the heartbeat confirms the worker's leases, events and
    checkpoints that take no follow-ups are stored without asking whether the attempt holds the
    run (what a lost attempt writes so is never read: a new attempt reads only its own checkpoints)."""
    events = EventRepo(database.sessionmaker)
    run = await expired_run(runs, conv, worker_id="w1")
    assert await claim_keeping_last(runs, run, "w2", lost=True) is not None

    fresh = Fence(run.id, 1, "w1", 30, hold=HoldClock())
    publisher = await publish_one_step(events, conv, fresh)
    await publisher.flush_store()
    await publisher.discard()

    assert len(await events.for_run(run.id)) == 1
    assert [row.seq for row in await runs.checkpoints(run.id, 1)] == [1]
    assert await runs.checkpoints(run.id, 2) == []


async def test_an_attempt_that_closed_its_run_still_holds_it_and_one_that_lost_it_does_not(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)

    def finish(run_id: str, attempt: int) -> Any:
        return runs.finish(
            run_id,
            status="completed",
            answer="a",
            iterations=1,
            usage={},
            elapsed=1.0,
            error=None,
            pending_injections=[],
            attempt=attempt,
        )

    run, _ = await runs.start(conv.id, "alice", "q", worker_id="w1", lease_s=30, start_cursor="0-0")
    own = Fence(run.id, 1, "w1", 30)
    assert await events.holds_run(own)
    assert await finish(run.id, 1)
    assert await events.holds_run(own)
    # What it still stores after its close is its own: kept, even fenced.
    late = StoredEvent(f"{time.time_ns() // 1_000_000}-0", "step", "{}", run.id)
    await events.save(conv.id, [late], [], own)
    assert [e.id for e in await events.for_run(run.id)] == [late.id]

    other = await expired_run(runs, conv, worker_id="w1")
    claimed = await claim_keeping_last(runs, other, "w2", lost=True)
    assert claimed is not None
    stalled = Fence(other.id, 1, "w1", 30)
    assert not await events.holds_run(stalled)
    assert await finish(other.id, 2)  # the attempt that took it over closes it
    assert not await events.holds_run(stalled)
    assert await events.holds_run(Fence(other.id, 2, "w2", 30))
    with pytest.raises(AttemptLostError):
        await events.save(conv.id, [StoredEvent("9999999999999-0", "step", "{}", other.id)], [], stalled)
    assert await events.for_run(other.id) == []


# ---- pruning -----------------------------------------------------------------------------------


async def test_prune_deletes_the_checkpoints_of_runs_finished_before_the_cutoff_and_old_tool_effects(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)
    now = utcnow()

    async def run_with_checkpoints(worker_id: str, count: int) -> str:
        run, _ = await runs.start(conv.id, "alice", "q", worker_id=worker_id, lease_s=30, start_cursor="0-0")
        records = [CheckpointRecord(run.id, 1, seq, '{"v":[0]}') for seq in range(count)]
        await events.save(conv.id, [], records)
        return run.id

    async def close(run_id: str, status: str, finished_at: datetime) -> None:
        assert await runs.finish(
            run_id,
            status=status,
            answer="",
            iterations=0,
            usage={},
            elapsed=1.0,
            error=None,
            pending_injections=[],
        )
        async with database.sessionmaker.begin() as session:
            await session.execute(update(Run).where(Run.id == run_id).values(finished_at=finished_at))

    old_done = await run_with_checkpoints("w", 2)
    await close(old_done, "completed", now - timedelta(hours=2))
    old_failed = await run_with_checkpoints("w", 1)
    await close(old_failed, "failed", now - timedelta(hours=3))
    recent = await run_with_checkpoints("w", 2)
    await close(recent, "cancelled", now - timedelta(minutes=5))
    running = await run_with_checkpoints("w", 3)
    async with database.sessionmaker.begin() as session:
        for key, created in (("old", now - timedelta(days=10)), ("new", now - timedelta(hours=1))):
            session.add(ToolEffect(idempotency_key=key, owner="alice", result="r", created_at=created))

    gone = await runs.prune(now - timedelta(hours=1), now - timedelta(days=1))

    assert gone == 2 + 1 + 1  # three checkpoints of the two old runs, one tool effect
    assert await runs.checkpoints(old_done, 1) == [] and await runs.checkpoints(old_failed, 1) == []
    assert len(await runs.checkpoints(recent, 1)) == 2
    assert len(await runs.checkpoints(running, 1)) == 3
    async with database.sessionmaker() as session:
        assert list(await session.scalars(select(ToolEffect.idempotency_key))) == ["new"]
    assert await runs.prune(now - timedelta(hours=1), now - timedelta(days=1)) == 0


async def test_prune_without_a_checkpoint_cutoff_keeps_every_checkpoint_and_prunes_old_tool_effects(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    # CHECKPOINT_RETENTION_S unset (the default): a finished run's checkpoints stay for replays
    # (FACES.md B-06), while old tool effects still go.
    events = EventRepo(database.sessionmaker)
    now = utcnow()
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="w", lease_s=30, start_cursor="0-0")
    await events.save(conv.id, [], [CheckpointRecord(run.id, 1, seq, '{"v":[0]}') for seq in range(2)])
    closed = await runs.finish(
        run.id,
        status="completed",
        answer="",
        iterations=0,
        usage={},
        elapsed=1.0,
        error=None,
        pending_injections=[],
    )
    assert closed
    long_ago = now - timedelta(days=400)
    async with database.sessionmaker.begin() as session:
        await session.execute(update(Run).where(Run.id == run.id).values(finished_at=long_ago))
        session.add(ToolEffect(idempotency_key="old", owner="alice", result="r", created_at=long_ago))

    assert await runs.prune(None, now - timedelta(days=1)) == 1

    assert len(await runs.checkpoints(run.id, 1)) == 2
    async with database.sessionmaker() as session:
        assert list(await session.scalars(select(ToolEffect.idempotency_key))) == []
