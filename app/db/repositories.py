"""Repositories: the only code that speaks SQL. They return frozen records, never ORM objects.

Every write is one transaction whose first statement is the write itself (or a lock-taking
UPDATE): on SQLite a transaction that reads first and writes later can fail with SQLITE_BUSY when
another worker wrote in between, and on PostgreSQL the UPDATE serialises concurrent writers.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from sqlalchemy import Table, and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import ConversationNotFoundError, EventIdTakenError, InvalidCursorError, RunActiveError
from app.db.models import RUN_STATUSES, Conversation, Message, Run, RunEvent, utcnow
from app.llm.base import ChatMessage, Role, ToolCall
from app.streaming.bus import StoredEvent, later_cursor, parse_cursor

FINAL_STATUSES = frozenset(RUN_STATUSES) - {"running"}

_conversations: Table = Conversation.__table__  # type: ignore[assignment]
_messages: Table = Message.__table__  # type: ignore[assignment]
_runs: Table = Run.__table__  # type: ignore[assignment]
_events: Table = RunEvent.__table__  # type: ignore[assignment]

# The statements of a run's life (start, stream, finish), built once on the tables. Built per call
# through the ORM, the statement's construction, its cache key and the unit of work's flush cost
# more of the worker's CPU than executing it: a run's database work took 15 ms of user CPU on
# SQLite and 13.5 on PostgreSQL that way, 9 and 8.5 now (bench/db_bench.py, in RESULTS.md's
# optimisations). An UPDATE or INSERT without values() sets the columns its parameters name.
_CONVERSATION_OF_OWNER = select(_conversations).where(
    _conversations.c.id == bindparam("b_id"), _conversations.c.owner == bindparam("b_owner")
)
_TOUCH_CONVERSATION = update(_conversations).where(_conversations.c.id == bindparam("b_id"))
_LAST_SEQ = select(func.max(_messages.c.seq)).where(
    _messages.c.conversation_id == bindparam("b_conversation")
)
_HISTORY = (
    select(_messages)
    .where(_messages.c.conversation_id == bindparam("b_conversation"))
    .order_by(_messages.c.seq)
)
_RUN = select(_runs).where(_runs.c.id == bindparam("b_id"))
_RUN_OF_OWNER = _RUN.where(_runs.c.owner == bindparam("b_owner"))
_ACTIVE_RUN = select(_runs).where(
    _runs.c.conversation_id == bindparam("b_conversation"), _runs.c.status == "running"
)
_LATEST_RUN = (
    select(_runs)
    .where(_runs.c.conversation_id == bindparam("b_conversation"))
    .order_by(_runs.c.created_at.desc(), _runs.c.id.desc())
    .limit(1)
)
_FINISH_RUN = update(_runs).where(_runs.c.id == bindparam("b_id"), _runs.c.status == "running")
_SET_START_CURSOR = update(_runs).where(_runs.c.id == bindparam("b_id"))
_EVENT_STORED = select(_events.c.run_id, _events.c.event, _events.c.data).where(
    _events.c.conversation_id == bindparam("b_conversation"),
    _events.c.cursor_ms == bindparam("b_ms"),
    _events.c.cursor_seq == bindparam("b_seq"),
)
_LAST_EVENT_ID = (
    select(_events.c.id)
    .where(_events.c.conversation_id == bindparam("b_conversation"))
    .order_by(_events.c.cursor_ms.desc(), _events.c.cursor_seq.desc())
    .limit(1)
)
_EVENTS_AFTER = (
    select(_events)
    .where(
        _events.c.conversation_id == bindparam("b_conversation"),
        or_(
            _events.c.cursor_ms > bindparam("b_ms"),
            and_(_events.c.cursor_ms == bindparam("b_ms"), _events.c.cursor_seq > bindparam("b_seq")),
        ),
    )
    .order_by(_events.c.cursor_ms, _events.c.cursor_seq)
    .limit(bindparam("b_limit"))
)


def new_conversation_id() -> str:
    return "conv_" + secrets.token_urlsafe(16)


def new_run_id() -> str:
    return "run_" + secrets.token_urlsafe(16)


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    id: str
    owner: str
    title: str
    agent_config: dict[str, Any]
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class MessageRecord:
    id: int
    conversation_id: str
    run_id: str | None
    seq: int
    role: Role
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    tool_call_id: str | None
    name: str | None
    pinned: bool
    created_at: datetime

    def to_chat_message(self) -> ChatMessage:
        return ChatMessage(
            role=self.role,
            content=self.content,
            tool_calls=self.tool_calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
            pinned=self.pinned,
        )


@dataclass(frozen=True, slots=True)
class RunRecord:
    id: str
    conversation_id: str
    owner: str
    status: str
    message: str
    answer: str | None
    iterations: int
    usage: dict[str, Any]
    elapsed: float | None
    error: str | None
    pending_injections: list[str]
    start_cursor: str
    worker_id: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    finished_at: datetime | None


def _conversation_record(row: Any) -> ConversationRecord:
    """From an ORM object or a row of the table (the same names)."""
    return ConversationRecord(
        id=row.id,
        owner=row.owner,
        title=row.title,
        agent_config=dict(row.agent_config),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _message_record(row: Any) -> MessageRecord:
    return MessageRecord(
        id=row.id,
        conversation_id=row.conversation_id,
        run_id=row.run_id,
        seq=row.seq,
        role=row.role,  # only ChatMessage roles are ever written
        content=row.content,
        tool_calls=tuple(
            ToolCall(id=tc["id"], name=tc["name"], arguments=tc["arguments"]) for tc in row.tool_calls or ()
        ),
        tool_call_id=row.tool_call_id,
        name=row.name,
        pinned=row.pinned,
        created_at=row.created_at,
    )


def _run_record(row: Any) -> RunRecord:
    return RunRecord(
        id=row.id,
        conversation_id=row.conversation_id,
        owner=row.owner,
        status=row.status,
        message=row.message,
        answer=row.answer,
        iterations=row.iterations,
        usage=dict(row.usage),
        elapsed=row.elapsed,
        error=row.error,
        pending_injections=list(row.pending_injections),
        start_cursor=row.start_cursor,
        worker_id=row.worker_id,
        lease_expires_at=row.lease_expires_at,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )


async def _append_messages(
    session: AsyncSession, conversation_id: str, run_id: str | None, messages: Sequence[ChatMessage]
) -> None:
    """Append ``messages`` after the conversation's last one and mark the conversation updated,
    inside the caller's transaction. Raises ``ConversationNotFoundError`` if the conversation is gone.
    """
    now = utcnow()
    # Lock the conversation row first, so that concurrent appends cannot take the same seq.
    touched = await session.execute(_TOUCH_CONVERSATION, {"b_id": conversation_id, "updated_at": now})
    if not touched.rowcount:  # type: ignore[attr-defined]
        raise ConversationNotFoundError(conversation_id)
    last = await session.scalar(_LAST_SEQ, {"b_conversation": conversation_id})
    first_seq = 0 if last is None else last + 1
    await session.execute(
        insert(_messages),
        [
            {
                "conversation_id": conversation_id,
                "run_id": run_id,
                "seq": first_seq + offset,
                "role": message.role,
                "content": message.content,
                "tool_calls": [
                    {"id": tc.id, "name": tc.name, "arguments": tc.arguments} for tc in message.tool_calls
                ]
                or None,
                "tool_call_id": message.tool_call_id,
                "name": message.name,
                "pinned": message.pinned,
                "created_at": now,
            }
            for offset, message in enumerate(messages)
        ],
    )


async def _history(session: AsyncSession, conversation_id: str) -> list[ChatMessage]:
    rows = await session.execute(_HISTORY, {"b_conversation": conversation_id})
    return [_message_record(row).to_chat_message() for row in rows]


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _event_row(conversation_id: str, stored: StoredEvent) -> dict[str, Any]:
    ms, seq = _event_cursor(stored.id)
    return {
        "conversation_id": conversation_id,
        "cursor_ms": ms,
        "cursor_seq": seq,
        "run_id": stored.run_id,
        "id": stored.id,
        "event": stored.event,
        "data": stored.data,
    }


async def _insert_events(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """Insert event rows in the caller's transaction, skipping ids already stored; how many were new
    (exact for one row; executemany may not count)."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    result = await session.execute(insert(_events).on_conflict_do_nothing(), rows)
    return int(result.rowcount)  # type: ignore[attr-defined]


async def _holds(session: AsyncSession, conversation_id: str, event: StoredEvent) -> bool:
    """Whether ``event`` itself (its id with its bytes) is stored."""
    ms, seq = _event_cursor(event.id)
    params = {"b_conversation": conversation_id, "b_ms": ms, "b_seq": seq}
    row = (await session.execute(_EVENT_STORED, params)).first()
    return row is not None and tuple(row) == (event.run_id, event.event, event.data)


def _event_record(row: Any) -> StoredEvent:
    return StoredEvent(id=row.id, event=row.event, data=row.data, run_id=row.run_id)


def encode_page_cursor(created_at: datetime, conversation_id: str) -> str:
    raw = json.dumps([created_at.astimezone(UTC).isoformat(), conversation_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_page_cursor(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) a page cursor points after; ``InvalidCursorError`` for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        stamp, conversation_id = json.loads(raw)
        created_at = datetime.fromisoformat(stamp)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise InvalidCursorError(f"invalid cursor {cursor!r}") from exc
    if not isinstance(conversation_id, str) or created_at.tzinfo is None:
        raise InvalidCursorError(f"invalid cursor {cursor!r}")
    return created_at, conversation_id


def _event_cursor(cursor: str) -> tuple[int, int]:
    try:
        return parse_cursor(cursor)
    except ValueError as exc:
        raise InvalidCursorError(str(exc)) from exc


class ConversationRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def create(self, owner: str, title: str, agent_config: dict[str, Any]) -> ConversationRecord:
        now = utcnow()
        record = ConversationRecord(new_conversation_id(), owner, title, dict(agent_config), now, now)
        async with self._sessionmaker.begin() as session:
            await session.execute(
                insert(_conversations),
                {
                    "id": record.id,
                    "owner": owner,
                    "title": title,
                    "agent_config": agent_config,
                    "created_at": now,
                    "updated_at": now,
                },
            )
        return record

    async def get(self, owner: str, conversation_id: str) -> ConversationRecord | None:
        """The conversation if ``owner`` owns it; None otherwise (another owner's looks absent)."""
        async with self._sessionmaker() as session:
            row = (
                await session.execute(_CONVERSATION_OF_OWNER, {"b_id": conversation_id, "b_owner": owner})
            ).first()
        return _conversation_record(row) if row is not None else None

    async def list(
        self, owner: str, limit: int, cursor: str | None
    ) -> tuple[list[ConversationRecord], str | None]:
        """``owner``'s conversations newest first, and the cursor of the next page (None at the end)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        query = select(Conversation).where(Conversation.owner == owner)
        if cursor is not None:
            created_at, after_id = decode_page_cursor(cursor)
            query = query.where(
                or_(
                    Conversation.created_at < created_at,
                    and_(Conversation.created_at == created_at, Conversation.id < after_id),
                )
            )
        query = query.order_by(Conversation.created_at.desc(), Conversation.id.desc()).limit(limit + 1)
        async with self._sessionmaker() as session:
            rows = list(await session.scalars(query))
        page = [_conversation_record(row) for row in rows[:limit]]
        next_cursor = encode_page_cursor(page[-1].created_at, page[-1].id) if len(rows) > limit else None
        return page, next_cursor

    async def delete(self, owner: str, conversation_id: str) -> bool:
        """Delete the conversation with its messages, runs and events; False if ``owner`` has no such one."""
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                delete(Conversation).where(Conversation.id == conversation_id, Conversation.owner == owner)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def add_messages(
        self, conversation_id: str, run_id: str | None, messages: Sequence[ChatMessage]
    ) -> None:
        """Append ``messages`` after the conversation's last one and mark the conversation updated.

        Raises ``ConversationNotFoundError`` if the conversation is gone.
        """
        if not messages:
            return
        async with self._sessionmaker.begin() as session:
            await _append_messages(session, conversation_id, run_id, messages)

    # builtins.list: inside this class, ``list`` names the method above.
    async def messages(self, conversation_id: str) -> builtins.list[MessageRecord]:
        async with self._sessionmaker() as session:
            rows = await session.scalars(
                select(Message).where(Message.conversation_id == conversation_id).order_by(Message.seq)
            )
            return [_message_record(row) for row in rows]

    async def history(self, conversation_id: str) -> builtins.list[ChatMessage]:
        async with self._sessionmaker() as session:
            return await _history(session, conversation_id)


class RunRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    @staticmethod
    def _new_row(
        conversation_id: str, owner: str, message: str, worker_id: str, lease_s: float, start_cursor: str
    ) -> dict[str, Any]:
        now = utcnow()
        return {
            "id": new_run_id(),
            "conversation_id": conversation_id,
            "owner": owner,
            "status": "running",
            "message": message,
            "answer": None,
            "iterations": 0,
            "usage": {},
            "elapsed": None,
            "error": None,
            "pending_injections": [],
            "start_cursor": start_cursor,
            "worker_id": worker_id,
            "lease_expires_at": now + timedelta(seconds=lease_s),
            "created_at": now,
            "finished_at": None,
        }

    async def _explain_conflict(self, conversation_id: str) -> NoReturn:
        """After an IntegrityError inserting a run: run ids are random, so the insert can only
        break the foreign key or the one-running-run index; which one is told apart without
        parsing driver messages."""
        async with self._sessionmaker() as session:
            exists = await session.scalar(select(Conversation.id).where(Conversation.id == conversation_id))
        if exists is None:
            raise ConversationNotFoundError(conversation_id) from None
        raise RunActiveError(conversation_id) from None

    async def start(
        self,
        conversation_id: str,
        owner: str,
        message: str,
        *,
        worker_id: str,
        lease_s: float,
        start_cursor: str,
        prior: Sequence[ChatMessage] = (),
    ) -> tuple[RunRecord, list[ChatMessage]]:
        """Insert a running run leased to ``worker_id`` and, in the same transaction, store
        ``prior`` turns (a whole chat sent at once), read the conversation's history, then store
        the question: one write, and a history that is exactly what came before this run.
        Returns the run and that history.

        The run's ``start_cursor`` is the later of ``start_cursor`` (what the bus held) and the
        conversation's last stored event, read after the insert: a previous run's ``done`` is
        stored in the transaction that closed it (``finish``), and this insert can only succeed
        once that close is committed, so the new run's events come after that done, however
        late the done reaches the bus.

        Raises ``RunActiveError`` if a run of the conversation is running (the partial unique index
        decides, so of two concurrent starts exactly one wins) and ``ConversationNotFoundError`` if
        the conversation does not exist.
        """
        row = self._new_row(conversation_id, owner, message, worker_id, lease_s, start_cursor)
        try:
            async with self._sessionmaker.begin() as session:
                await session.execute(insert(_runs), row)  # the one-running-run index decides here
                stored_last = await session.scalar(_LAST_EVENT_ID, {"b_conversation": conversation_id})
                cursor = later_cursor(start_cursor, stored_last)
                if cursor != start_cursor:
                    row["start_cursor"] = cursor
                    await session.execute(_SET_START_CURSOR, {"b_id": row["id"], "start_cursor": cursor})
                if prior:
                    await _append_messages(session, conversation_id, None, prior)
                history = await _history(session, conversation_id)
                await _append_messages(
                    session, conversation_id, row["id"], [ChatMessage(role="user", content=message)]
                )
        except IntegrityError:
            await self._explain_conflict(conversation_id)
        return RunRecord(**row), history

    async def get(self, owner: str, run_id: str) -> RunRecord | None:
        """The run if ``owner`` owns it; None otherwise."""
        return await self._one(_RUN_OF_OWNER, {"b_id": run_id, "b_owner": owner})

    async def get_any(self, run_id: str) -> RunRecord | None:
        return await self._one(_RUN, {"b_id": run_id})

    async def active(self, conversation_id: str) -> RunRecord | None:
        return await self._one(_ACTIVE_RUN, {"b_conversation": conversation_id})

    async def latest(self, conversation_id: str) -> RunRecord | None:
        return await self._one(_LATEST_RUN, {"b_conversation": conversation_id})

    async def finish(
        self,
        run_id: str,
        *,
        status: str,
        answer: str,
        iterations: int,
        usage: dict[str, Any],
        elapsed: float,
        error: str | None,
        pending_injections: list[str],
        messages: Sequence[ChatMessage] = (),
        conversation_id: str | None = None,
        done: StoredEvent | None = None,
    ) -> bool:
        """Close the run if it is still running; False if someone else closed it first.

        ``messages`` (what the run added to conversation ``conversation_id``) are stored in the
        same transaction, whether or not the run was still running. ``done`` (the run's last
        event, from ``RunPublisher.stamp``) is stored with the close, so that a closed run always
        has its done in the log and the next run of the conversation starts after it
        (``start``). A retry of a close whose commit went through but whose answer was lost
        finds its very done stored (same id, same bytes) and returns True again; another closer's
        done, even under the same id, does not count. Raises ``EventIdTakenError``, keeping
        nothing, if the run was open but another event holds the done's id.
        """
        if status not in FINAL_STATUSES:
            raise ValueError(f"a run cannot finish as {status!r}")
        if (messages or done is not None) and conversation_id is None:
            raise ValueError("messages and done need their conversation_id")
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                _FINISH_RUN,
                {
                    "b_id": run_id,
                    "status": status,
                    "answer": answer,
                    "iterations": iterations,
                    "usage": usage,
                    "elapsed": elapsed,
                    "error": error,
                    "pending_injections": list(pending_injections),
                    "lease_expires_at": None,
                    "finished_at": utcnow(),
                },
            )
            closed = bool(result.rowcount)  # type: ignore[attr-defined]
            if conversation_id is not None:
                if done is not None and not closed and await _holds(session, conversation_id, done):
                    return True  # this very close, committed by an earlier attempt
                if messages:
                    await _append_messages(session, conversation_id, run_id, messages)
                if (
                    done is not None
                    and closed
                    and not await _insert_events(session, [_event_row(conversation_id, done)])
                ):
                    # Another process stored an event under this id: a close without its done in
                    # the log would leave readers waiting. Undo it all; the caller restamps.
                    raise EventIdTakenError(done.id)
        return closed

    async def renew_leases(self, run_ids: Sequence[str], worker_id: str, lease_s: float) -> None:
        """Extend the leases of those of ``run_ids`` still running on ``worker_id``."""
        if not run_ids:
            return
        async with self._sessionmaker.begin() as session:
            await session.execute(
                update(Run)
                .where(Run.id.in_(list(run_ids)), Run.worker_id == worker_id, Run.status == "running")
                .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            )

    async def expired(self, now: datetime | None = None) -> list[RunRecord]:
        """Running runs whose lease ran out before ``now``: their worker is presumed dead."""
        moment = now if now is not None else utcnow()
        return await self._all(
            select(Run)
            .where(Run.status == "running", Run.lease_expires_at < moment)
            .order_by(Run.lease_expires_at)
        )

    async def running_of_worker(self, worker_id: str) -> list[RunRecord]:
        return await self._all(
            select(Run).where(Run.status == "running", Run.worker_id == worker_id).order_by(Run.created_at)
        )

    async def counts_by_status(self) -> dict[str, int]:
        """Number of runs per status, every status present (zero included)."""
        counts = dict.fromkeys(RUN_STATUSES, 0)
        async with self._sessionmaker() as session:
            for status, count in await session.execute(select(Run.status, func.count()).group_by(Run.status)):
                counts[status] = count
        return counts

    async def _one(self, query: Any, params: dict[str, Any]) -> RunRecord | None:
        async with self._sessionmaker() as session:
            row = (await session.execute(query, params)).first()
        return _run_record(row) if row is not None else None

    async def _all(self, query: Any) -> list[RunRecord]:
        async with self._sessionmaker() as session:
            return [_run_record(row) for row in await session.scalars(query)]


GROUP_ROWS = 5000
"""Most event rows one group commit writes (one transaction stays short)."""


@dataclass(slots=True)
class _PendingSave:
    conversation_id: str
    rows: list[dict[str, Any]]
    future: asyncio.Future[None]


class EventRepo:
    """The durable event log.

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

    async def save(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        """Store ``events``; ids already stored are skipped, so a retry is harmless.

        Returns once they are committed. Raises ``ConversationNotFoundError`` if the conversation
        is gone (deleted mid-run), or what the database raised for the transaction they were in.
        """
        if not events:
            return
        rows = [_event_row(conversation_id, stored) for stored in events]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        # A caller cancelled meanwhile leaves its outcome unread: read it here, quietly.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._queue.append(_PendingSave(conversation_id, rows, future))
        writer = self._writer
        if writer is not None and writer.get_loop() is not loop:
            # Left behind by an event loop that is gone (tests run one per test): so is its queue.
            self._queue = [pending for pending in self._queue if pending.future.get_loop() is loop]
            writer = None
        if writer is None or writer.done():
            # A task of its own, so that a caller that stops waiting does not stop the others' write.
            self._writer = asyncio.create_task(self._write_queued(), name="event-store-writer")
        await asyncio.shield(future)

    async def _write_queued(self) -> None:
        batch: list[_PendingSave] = []
        try:
            while self._queue:
                # Whole saves, up to GROUP_ROWS rows a transaction (a save bigger than that alone).
                size = 0
                for taken, pending in enumerate(self._queue):
                    size += len(pending.rows)
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
            await self._insert([row for pending in batch for row in pending.rows])
        except IntegrityError:
            # Conflicts are skipped, so only the foreign key can fail: a conversation is gone.
            # Each on its own, to tell whose.
            if len(batch) == 1:
                _settle(batch[0].future, ConversationNotFoundError(batch[0].conversation_id))
                return
            for pending in batch:
                await self._write([pending])
            return
        except Exception as exc:
            for pending in batch:
                _settle(pending.future, exc)
            return
        for pending in batch:
            _settle(pending.future, None)

    async def _insert(self, rows: list[dict[str, Any]]) -> None:
        async with self._sessionmaker.begin() as session:
            await _insert_events(session, rows)

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
