"""Claiming runs for a new attempt (RUNS.md R-03, R-07, R-08, R-11) against real SQLite and
PostgreSQL: one claim wins, the new attempt's first checkpoint is stored with it, an attempt that
lost the run can neither close it nor add to its checkpoints."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.follow_ups import FollowUpRepo
from app.db.repositories.runs import CheckpointRow
from app.db.session import Database
from app.llm.base import ChatMessage
from app.streaming.bus import StoredEvent
from app.streaming.store import AttemptLostError, CheckpointRecord, Fence


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

    claims = await asyncio.gather(
        *(claim_keeping_last(runs, run, f"w{i}", lost=True) for i in range(4))
    )

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
