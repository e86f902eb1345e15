"""EventRepo against real SQLite and PostgreSQL: the durable copy of every conversation's events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import event as sa_event

from app.db.errors import ConversationNotFoundError, InvalidCursorError
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo
from app.db.session import Database
from app.streaming.bus import ZERO_CURSOR, StoredEvent


@pytest.fixture
def events(database: Database) -> EventRepo:
    return EventRepo(database.sessionmaker)


@pytest.fixture
async def conv(database: Database) -> ConversationRecord:
    return await ConversationRepo(database.sessionmaker).create("alice", "events", {})


def event(cursor: str, run_id: str = "run_a", kind: str = "step", data: str | None = None) -> StoredEvent:
    return StoredEvent(
        id=cursor, event=kind, data=data if data is not None else f'{{"at":"{cursor}"}}', run_id=run_id
    )


async def test_saved_events_read_back_in_cursor_order_with_data_byte_for_byte(
    events: EventRepo, conv: ConversationRecord
) -> None:
    odd_json = '{"content": "naïve — 💡\\n",  "n":1.50, "run_id":"run_a"}'
    batch = [
        event("999-0"),
        event("999-1", data=odd_json),
        event("1000-0"),
        event("1000-10"),
        event("1000-2"),
    ]

    await events.save(conv.id, batch)

    # Numeric order, not text order: "1000-0" follows "999-1" and "1000-2" precedes "1000-10".
    expected = [batch[0], batch[1], batch[2], batch[4], batch[3]]
    assert await events.read_after(conv.id, ZERO_CURSOR) == expected
    assert (await events.read_after(conv.id, ZERO_CURSOR))[1].data == odd_json


async def test_read_after_starts_strictly_after_the_cursor_and_honours_the_limit(
    events: EventRepo, conv: ConversationRecord
) -> None:
    batch = [event(f"{ms}-{seq}") for ms in (5, 6, 7) for seq in (0, 1)]
    await events.save(conv.id, batch)

    assert await events.read_after(conv.id, "6-0") == batch[3:]
    assert await events.read_after(conv.id, "6-0", limit=2) == batch[3:5]
    assert await events.read_after(conv.id, "6-5") == batch[4:]
    assert await events.read_after(conv.id, "7-1") == []


async def test_save_is_idempotent_under_retries_and_overlapping_batches(
    events: EventRepo, conv: ConversationRecord
) -> None:
    first = [event("1-0"), event("1-1"), event("2-0")]
    await events.save(conv.id, first)

    await events.save(conv.id, first)
    await events.save(conv.id, [*first[1:], event("3-0")])

    assert [e.id for e in await events.read_after(conv.id, ZERO_CURSOR)] == ["1-0", "1-1", "2-0", "3-0"]


async def test_concurrent_retries_of_one_batch_store_it_once(
    events: EventRepo, conv: ConversationRecord
) -> None:
    batch = [event(f"10-{seq}") for seq in range(20)]

    await asyncio.gather(*(events.save(conv.id, batch) for _ in range(3)))

    assert await events.read_after(conv.id, ZERO_CURSOR) == batch


async def test_a_retry_keeps_the_first_stored_copy(events: EventRepo, conv: ConversationRecord) -> None:
    await events.save(conv.id, [event("1-0", data='{"v":1}')])

    await events.save(conv.id, [event("1-0", data='{"v":2}')])

    assert [e.data for e in await events.read_after(conv.id, ZERO_CURSOR)] == ['{"v":1}']


async def test_save_of_nothing_is_a_no_op(events: EventRepo, conv: ConversationRecord) -> None:
    await events.save(conv.id, [])

    assert await events.last_id(conv.id) is None


async def test_a_large_batch_is_saved_in_one_call(events: EventRepo, conv: ConversationRecord) -> None:
    batch = [event(f"{1700000000000 + i // 7}-{i % 7}") for i in range(2500)]

    await events.save(conv.id, batch)

    assert await events.read_after(conv.id, ZERO_CURSOR, limit=5000) == batch


async def test_events_of_one_conversation_never_leak_into_another(
    database: Database, events: EventRepo
) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    a = await conversations.create("alice", "a", {})
    b = await conversations.create("alice", "b", {})
    # The same cursor in two conversations: cursors are per conversation.
    await events.save(a.id, [event("1-0", run_id="run_a")])
    await events.save(b.id, [event("1-0", run_id="run_b"), event("2-0", run_id="run_b")])

    assert [e.run_id for e in await events.read_after(a.id, ZERO_CURSOR)] == ["run_a"]
    assert await events.last_id(a.id) == "1-0"
    assert await events.last_id(b.id) == "2-0"


async def test_for_run_returns_that_runs_events_in_order(events: EventRepo, conv: ConversationRecord) -> None:
    await events.save(conv.id, [event("1-0", "run_a"), event("1-1", "run_a", "done")])
    await events.save(conv.id, [event("2-0", "run_b"), event("3-0", "run_b", "done")])

    assert [e.id for e in await events.for_run("run_b")] == ["2-0", "3-0"]
    assert [e.event for e in await events.for_run("run_a")] == ["step", "done"]
    assert await events.for_run("run_missing") == []


async def test_last_id_is_the_greatest_cursor_not_the_last_saved(
    events: EventRepo, conv: ConversationRecord
) -> None:
    assert await events.last_id(conv.id) is None
    await events.save(conv.id, [event("1000-0"), event("999-5")])

    assert await events.last_id(conv.id) == "1000-0"


async def test_events_of_a_missing_conversation_raise_conversation_not_found(events: EventRepo) -> None:
    with pytest.raises(ConversationNotFoundError):
        await events.save("conv_missing", [event("1-0")])


@pytest.mark.parametrize("cursor", ["", "abc", "1-", "-1", "1-2-3", "1.5-0"])
async def test_read_after_an_invalid_cursor_raises_invalid_cursor_error(
    events: EventRepo, conv: ConversationRecord, cursor: str
) -> None:
    with pytest.raises(InvalidCursorError):
        await events.read_after(conv.id, cursor)


async def test_save_of_an_event_with_an_invalid_id_raises_invalid_cursor_error(
    events: EventRepo, conv: ConversationRecord
) -> None:
    with pytest.raises(InvalidCursorError):
        await events.save(conv.id, [event("1-0"), event("not-a-cursor")])

    assert await events.last_id(conv.id) is None


# ---- group commit ------------------------------------------------------------------------------


def count_commits(database: Database) -> list[int]:
    commits = [0]

    def on_commit(_connection: object) -> None:
        commits[0] += 1

    sa_event.listen(database.engine.sync_engine, "commit", on_commit)
    return commits


async def test_saves_that_come_together_are_committed_together(database: Database, events: EventRepo) -> None:
    repo = ConversationRepo(database.sessionmaker)
    convs = [await repo.create("alice", f"c{i}", {}) for i in range(40)]
    commits = count_commits(database)

    await asyncio.gather(
        *(events.save(c.id, [event(f"{i + 1}-0"), event(f"{i + 1}-1")]) for i, c in enumerate(convs))
    )

    for i, c in enumerate(convs):
        assert [e.id for e in await events.read_after(c.id, ZERO_CURSOR)] == [f"{i + 1}-0", f"{i + 1}-1"]
    assert 1 <= commits[0] <= 2  # the first save alone, the 39 that queued behind it in one


async def test_a_deleted_conversation_fails_only_its_own_save_in_a_group(
    database: Database, events: EventRepo
) -> None:
    repo = ConversationRepo(database.sessionmaker)
    convs = [await repo.create("alice", f"c{i}", {}) for i in range(5)]
    saves = [events.save(c.id, [event("7-0")]) for c in convs]
    saves.insert(3, events.save("conv_gone", [event("7-0")]))

    outcomes = await asyncio.gather(*saves, return_exceptions=True)

    assert isinstance(outcomes[3], ConversationNotFoundError)
    assert [o for i, o in enumerate(outcomes) if i != 3] == [None] * 5
    for c in convs:
        assert [e.id for e in await events.read_after(c.id, ZERO_CURSOR)] == ["7-0"]


async def test_a_deleted_conversation_in_a_large_group_costs_a_few_transactions(
    database: Database, events: EventRepo
) -> None:
    repo = ConversationRepo(database.sessionmaker)
    convs = [await repo.create("alice", f"c{i}", {}) for i in range(40)]
    first = asyncio.create_task(events.save(convs[0].id, [event("7-0")]))
    await asyncio.sleep(0)  # its write is under way: the saves below queue behind it, as one group
    saves = [events.save(c.id, [event("7-0")]) for c in convs[1:]]
    saves.insert(17, events.save("conv_gone", [event("7-0")]))
    commits = count_commits(database)

    outcomes = await asyncio.gather(first, *saves, return_exceptions=True)

    assert isinstance(outcomes[18], ConversationNotFoundError)
    assert [o for i, o in enumerate(outcomes) if i != 18] == [None] * 40
    for c in convs:
        assert [e.id for e in await events.read_after(c.id, ZERO_CURSOR)] == ["7-0"]
    assert commits[0] <= 12  # halves: about two a level; one save at a time was one commit each (40)


async def test_a_caller_that_stops_waiting_does_not_stop_the_write(
    database: Database, events: EventRepo, conv: ConversationRecord
) -> None:
    other = await ConversationRepo(database.sessionmaker).create("alice", "other", {})
    first = asyncio.create_task(events.save(other.id, [event("1-0")]))
    await asyncio.sleep(0)  # the first save's write is under way; the next one queues behind it
    waiting = asyncio.create_task(events.save(conv.id, [event("2-0")]))
    await asyncio.sleep(0)
    waiting.cancel()
    await first

    async def stored() -> list[StoredEvent]:
        return await events.read_after(conv.id, ZERO_CURSOR)

    deadline = asyncio.get_running_loop().time() + 5
    while not await stored():
        assert asyncio.get_running_loop().time() < deadline, (
            "the cancelled caller's events were never written"
        )
        await asyncio.sleep(0.01)
    assert [e.id for e in await stored()] == ["2-0"]
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_stopped_writer_fails_its_waiters_and_the_next_save_starts_a_new_one(
    database: Database, conv: ConversationRecord
) -> None:
    gate = asyncio.Event()
    entered = asyncio.Event()
    real_begin = database.sessionmaker.begin

    @contextlib.asynccontextmanager
    async def held_begin() -> AsyncIterator[Any]:
        entered.set()
        await gate.wait()  # the write hangs (a stalled database) until the test lets it go
        async with real_begin() as session:
            yield session

    class HeldSessions:
        def begin(self) -> Any:
            return held_begin()

    events = EventRepo(HeldSessions())  # type: ignore[arg-type]
    waiting = asyncio.create_task(events.save(conv.id, [event("1-0")]))
    await asyncio.wait_for(entered.wait(), 5)
    assert events._writer is not None
    events._writer.cancel()  # the loop is shutting down, say

    with pytest.raises(ConnectionError, match="writer was stopped"):
        await asyncio.wait_for(waiting, 5)
    gate.set()
    await asyncio.wait_for(events.save(conv.id, [event("2-0")]), 5)
    assert [e.id for e in await EventRepo(database.sessionmaker).read_after(conv.id, ZERO_CURSOR)] == ["2-0"]
