"""``EventRepo``: the durable event log, written in group commits."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import ConversationNotFoundError
from app.db.models import Run, RunEvent, utcnow
from app.db.repositories.rows import (
    _EVENTS_AFTER,
    _LAST_EVENT_ID,
    FINAL_STATUSES,
    EventValues,
    _checkpoints,
    _delete_follow_ups,
    _event_cursor,
    _event_record,
    _holds,
    _insert_for,
    event_values,
    insert_event_values,
)
from app.streaming.bus import StoredEvent
from app.streaming.store import AttemptLostError, CheckpointRecord, Fence


async def _fence(session: AsyncSession, fenced: list[_PendingSave]) -> list[_PendingSave]:
    """Renew the leases of the runs whose attempts write in ``fenced``; those whose attempt no
    longer holds its run (claimed by another worker) are returned."""
    if not fenced:
        return []
    held: set[tuple[str, int]] = set()
    by_worker: dict[tuple[str, float], set[str]] = {}
    for pending in fenced:
        fence = pending.fence
        assert fence is not None
        by_worker.setdefault((fence.worker_id, fence.lease_s), set()).add(fence.run_id)
    for (worker_id, lease_s), run_ids in by_worker.items():
        result = await session.execute(
            update(Run)
            .where(Run.id.in_(sorted(run_ids)), Run.worker_id == worker_id, Run.status == "running")
            .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            .returning(Run.id, Run.attempt)
        )
        held.update((row.id, row.attempt) for row in result)
    missing = {
        p.fence.run_id
        for p in fenced
        if p.fence is not None and (p.fence.run_id, p.fence.attempt) not in held
    }
    if missing:
        held.update(await _closed_by(session, missing))
    return [p for p in fenced if p.fence is not None and (p.fence.run_id, p.fence.attempt) not in held]


async def _closed_by(session: AsyncSession, run_ids: set[str]) -> list[tuple[str, int]]:
    """Of ``run_ids``, the runs that are closed, with the attempt that held them last: an attempt
    that closed its run itself did not lose it (what it still sends after its done is its own)."""
    rows = await session.execute(
        select(Run.id, Run.attempt).where(Run.id.in_(sorted(run_ids)), Run.status.in_(sorted(FINAL_STATUSES)))
    )
    return [(row.id, row.attempt) for row in rows]


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


GROUP_ROWS = 5000
"""Most event rows one group commit writes (one transaction stays short)."""


@dataclass(slots=True)
class _PendingSave:
    conversation_id: str
    rows: list[EventValues]
    future: asyncio.Future[None]
    checkpoint_rows: list[dict[str, Any]] = field(default_factory=list)
    follow_ups_through: int | None = None
    fence: Fence | None = None


class EventRepo:
    """The durable event log, and the run checkpoints written with it.

    ``save()`` commits as a group: the saves of every run of the process that come in while a
    write is in flight go out together in the next transaction, one INSERT for all their rows. At
    200 concurrent runs that is a few transactions a second instead of hundreds, each of which
    would hold SQLite's one writer (and its turn in the process's write queue, which the requests
    share) or a PostgreSQL connection.
    """

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker
        self._queue: list[_PendingSave] = []
        self._writer: asyncio.Task[None] | None = None

    async def save(
        self,
        conversation_id: str,
        events: Sequence[StoredEvent],
        checkpoints: Sequence[CheckpointRecord] = (),
        fence: Fence | None = None,
    ) -> None:
        """Store ``events`` and the run ``checkpoints`` that came with them, in one transaction;
        what is already stored is skipped, so a retry is harmless. The follow-ups a checkpoint
        records as taken leave the conversation's queue in the same transaction.

        With ``fence`` (an attempt of a run), they are stored only while that attempt holds the
        run, whose lease they renew; otherwise ``AttemptLostError`` and nothing is kept.

        Returns once they are committed. Raises ``ConversationNotFoundError`` if the conversation
        is gone (deleted mid-run), or what the database raised for the transaction they were in.
        """
        if not events and not checkpoints:
            return
        rows = [event_values(conversation_id, stored) for stored in events]
        now = utcnow()
        checkpoint_rows = [
            {
                "run_id": c.run_id,
                "attempt": c.attempt,
                "seq": c.seq,
                "after": c.after,
                "data": c.data,
                "created_at": now,
            }
            for c in checkpoints
        ]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        # A caller cancelled meanwhile leaves its outcome unread: read it here, quietly.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        taken = [c.follow_ups_through for c in checkpoints if c.follow_ups_through is not None]
        self._queue.append(
            _PendingSave(conversation_id, rows, future, checkpoint_rows, max(taken) if taken else None, fence)
        )
        writer = self._writer
        if writer is not None and writer.get_loop() is not loop:
            # Left behind by an event loop that is gone (tests run one per test): so is its queue.
            self._queue = [pending for pending in self._queue if pending.future.get_loop() is loop]
            writer = None
        if writer is None or writer.done():
            # A task of its own, so that a caller that stops waiting does not stop the others' write.
            # And a context of its own: it writes for every run, not the one whose save made it.
            self._writer = asyncio.create_task(
                self._write_queued(), name="event-store-writer", context=contextvars.Context()
            )
        await asyncio.shield(future)

    async def _write_queued(self) -> None:
        batch: list[_PendingSave] = []
        try:
            while self._queue:
                # Whole saves, up to GROUP_ROWS rows a transaction (a save bigger than that alone).
                size = 0
                for taken, pending in enumerate(self._queue):
                    size += len(pending.rows) + len(pending.checkpoint_rows)
                    if size > GROUP_ROWS and taken:
                        break
                else:
                    taken = len(self._queue)
                batch, self._queue = self._queue[:taken], self._queue[taken:]
                await self._write(batch)
        finally:
            self._writer = None
            # Cancelled mid-write (the loop is closing): whoever waits retries or gives up.
            for pending in (*batch, *self._queue):
                if not pending.future.done():
                    pending.future.set_exception(ConnectionError("the event writer was stopped"))
            self._queue = []

    async def _write(self, batch: list[_PendingSave]) -> None:
        try:
            lost = await self._insert(batch)
        except IntegrityError:
            # Conflicts are skipped, so only the foreign key can fail: a conversation is gone. Each
            # half again, to tell whose: a group is every run's saves of a moment (hundreds of
            # them, ``StoreWriter``'s save grid), and one gone conversation costs a few
            # transactions, not one per save.
            if len(batch) == 1:
                _settle(batch[0].future, ConversationNotFoundError(batch[0].conversation_id))
                return
            half = len(batch) // 2
            await self._write(batch[:half])
            await self._write(batch[half:])
            return
        except Exception as exc:
            for pending in batch:
                _settle(pending.future, exc)
            return
        for pending in batch:
            if pending in lost:
                fence = pending.fence
                assert fence is not None
                _settle(
                    pending.future,
                    AttemptLostError(f"attempt {fence.attempt} of {fence.run_id} lost the run"),
                )
            else:
                _settle(pending.future, None)

    async def _insert(self, batch: list[_PendingSave]) -> list[_PendingSave]:
        """One transaction for ``batch``; the saves left out because their attempt lost its run."""
        async with self._sessionmaker.begin() as session:
            # The fence first (a write: SQLite's lock, PostgreSQL's row locks, so that a claim of
            # the run is either before it, and the save is left out, or after its commit).
            lost = await _fence(session, [pending for pending in batch if pending.fence is not None])
            kept = [pending for pending in batch if pending not in lost]
            rows = [row for pending in kept for row in pending.rows]
            checkpoint_rows = [row for pending in kept for row in pending.checkpoint_rows]
            if rows:
                await insert_event_values(session, rows)
            if checkpoint_rows:
                # After the events they cover; a retried batch skips what its first try stored.
                await session.execute(
                    _insert_for(session)(_checkpoints).on_conflict_do_nothing(), checkpoint_rows
                )
            for pending in kept:
                if pending.follow_ups_through is not None:
                    await _delete_follow_ups(session, pending.conversation_id, pending.follow_ups_through)
        return lost

    async def holds_run(self, fence: Fence) -> bool:
        """Whether ``fence``'s attempt still holds its run (or closed it itself); renews its lease
        if it holds it."""
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(Run)
                .where(
                    Run.id == fence.run_id,
                    Run.attempt == fence.attempt,
                    Run.worker_id == fence.worker_id,
                    Run.status == "running",
                )
                .values(lease_expires_at=utcnow() + timedelta(seconds=fence.lease_s))
            )
            if result.rowcount:  # type: ignore[attr-defined]
                return True
            return (fence.run_id, fence.attempt) in await _closed_by(session, {fence.run_id})

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        """Up to ``limit`` events with a cursor greater than ``after``, oldest first."""
        ms, seq = _event_cursor(after)
        params = {"b_conversation": conversation_id, "b_ms": ms, "b_seq": seq, "b_limit": limit}
        async with self._sessionmaker() as session:
            return [_event_record(row) for row in await session.execute(_EVENTS_AFTER, params)]

    async def for_run(self, run_id: str) -> list[StoredEvent]:
        query = (
            select(RunEvent)
            .where(RunEvent.run_id == run_id)
            .order_by(RunEvent.cursor_ms, RunEvent.cursor_seq)
        )
        async with self._sessionmaker() as session:
            return [_event_record(row) for row in await session.scalars(query)]

    async def last_id(self, conversation_id: str) -> str | None:
        async with self._sessionmaker() as session:
            return await session.scalar(_LAST_EVENT_ID, {"b_conversation": conversation_id})

    async def holds(self, conversation_id: str, event: StoredEvent) -> bool:
        """Whether ``event`` itself (its id with its bytes) is stored."""
        async with self._sessionmaker() as session:
            return await _holds(session, conversation_id, event)
