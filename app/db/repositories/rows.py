"""What the repositories share: the tables, the records they return, and the statements and
steps that several of them run inside their own transactions.

Every write is one transaction whose first statement is the write itself (or a lock-taking
UPDATE): on SQLite a transaction that reads first and writes later can fail with SQLITE_BUSY when
another worker wrote in between, and on PostgreSQL the UPDATE serialises concurrent writers.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import Table, and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.errors import ConversationNotFoundError, InvalidCursorError
from app.db.models import (
    ACTIVE_STATUSES,
    RUN_STATUSES,
    Checkpoint,
    Conversation,
    FollowUp,
    Message,
    Run,
    RunEvent,
    utcnow,
)
from app.llm.base import ChatMessage, Role, ToolCall
from app.streaming.bus import StoredEvent, parse_cursor

FINAL_STATUSES = frozenset(RUN_STATUSES) - frozenset(ACTIVE_STATUSES)

_conversations: Table = Conversation.__table__  # type: ignore[assignment]
_messages: Table = Message.__table__  # type: ignore[assignment]
_runs: Table = Run.__table__  # type: ignore[assignment]
_events: Table = RunEvent.__table__  # type: ignore[assignment]
_checkpoints: Table = Checkpoint.__table__  # type: ignore[assignment]

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
_MOVE_HEAD = (
    update(_conversations)
    .where(_conversations.c.id == bindparam("b_id"))
    .values(head_seq=bindparam("b_head"))
)
_MOVE_HEAD_FROM = _MOVE_HEAD.where(_conversations.c.head_seq == bindparam("b_from"))
_MOVE_HEAD_FROM_NONE = _MOVE_HEAD.where(_conversations.c.head_seq.is_(None))
_LOCK_CONVERSATION = _TOUCH_CONVERSATION.returning(_conversations.c.head_seq)
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
    head_seq: int | None = None
    """The current leaf of its tree of messages (FACES.md B-01); None while it has none."""


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
    reasoning: str | None = None
    parent_seq: int | None = None
    """The ``seq`` of the message this one follows in the conversation's tree (None: a root)."""
    client_id: str | None = None
    """The id a protocol face's client gave it (FACES.md V-02, G-02)."""

    @property
    def public_id(self) -> str:
        """The message's id in the API (``msg_<n>``)."""
        return message_public_id(self.id)

    def to_chat_message(self) -> ChatMessage:
        return ChatMessage(
            role=self.role,
            content=self.content,
            tool_calls=self.tool_calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
            pinned=self.pinned,
            reasoning=self.reasoning,
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
    attempt: int = 1
    lost_attempts: int = 0
    cancel_requested: bool = False
    model: str | None = None
    trace_id: str | None = None
    trace_parent: str | None = None
    """The W3C ``traceparent`` of the request that started the run: every attempt's span's parent."""
    question_seq: int | None = None
    """Its question's place in the conversation's tree (None: a run older than trees)."""
    client_tools: list[dict[str, Any]] | None = None
    """Tools the client runs, declared for this run alone (FACES.md C-01)."""
    replay_of: str | None = None
    """The run this one replays from a checkpoint (FACES.md B-06)."""
    webhook: str | None = None
    """Where its record is posted when it starts waiting and when it ends (FACES.md N-07)."""


def message_public_id(message_id: int) -> str:
    return f"msg_{message_id}"


def parse_message_id(public_id: str) -> int | None:
    """The database id of a message's API id, or None if it is not one."""
    digits = public_id[4:]
    if not public_id.startswith("msg_") or not digits.isascii() or not digits.isdigit() or len(digits) > 18:
        return None
    if digits != str(int(digits)):  # msg_007 is no id the service hands out (msg_7 is)
        return None
    return int(public_id[4:])


def new_conversation(owner: str, title: str, agent_config: dict[str, Any]) -> ConversationRecord:
    now = utcnow()
    return ConversationRecord(new_conversation_id(), owner, title, dict(agent_config), now, now)


async def _insert_conversation(session: AsyncSession, record: ConversationRecord) -> None:
    await session.execute(
        insert(_conversations),
        {
            "id": record.id,
            "owner": record.owner,
            "title": record.title,
            "agent_config": record.agent_config,
            "created_at": record.created_at,
            "updated_at": record.updated_at,
        },
    )


def _conversation_record(row: Any) -> ConversationRecord:
    """From an ORM object or a row of the table (the same names)."""
    return ConversationRecord(
        id=row.id,
        owner=row.owner,
        title=row.title,
        agent_config=dict(row.agent_config),
        created_at=row.created_at,
        updated_at=row.updated_at,
        head_seq=row.head_seq,
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
            ToolCall(id=tc["id"], name=tc["name"], arguments=tc["arguments"], extra=tc.get("extra"))
            for tc in row.tool_calls or ()
        ),
        tool_call_id=row.tool_call_id,
        name=row.name,
        pinned=row.pinned,
        created_at=row.created_at,
        reasoning=row.reasoning,
        parent_seq=row.parent_seq,
        client_id=row.client_id,
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
        attempt=row.attempt,
        lost_attempts=row.lost_attempts,
        cancel_requested=bool(row.cancel_requested),
        model=row.model,
        trace_id=row.trace_id,
        trace_parent=row.trace_parent,
        question_seq=row.question_seq,
        client_tools=list(row.client_tools) if row.client_tools is not None else None,
        replay_of=row.replay_of,
        webhook=row.webhook,
    )


async def _append_messages(
    session: AsyncSession,
    conversation_id: str,
    run_id: str | None,
    messages: Sequence[ChatMessage],
    *,
    parent_seq: int | None,
    locked: bool = False,
    first_seq: int | None = None,
    head_from: int | Literal["any", "stay"] | None = "any",
    client_ids: Sequence[str | None] = (),
) -> int:
    """Append ``messages`` to the conversation's tree, one below the other, the first below the
    message ``parent_seq`` (None: as a first message), and mark the conversation updated, inside
    the caller's transaction; returns the last one's seq. The conversation's head moves to it
    when the head is ``head_from`` (``"any"``: whatever it is; ``"stay"``: it does not). Raises
    ``ConversationNotFoundError`` if the conversation is gone.
    ``locked``: the caller has locked (touched) the conversation's row in this transaction.
    ``first_seq``: the seq after the conversation's last message, known to a caller that read
    the messages under that lock (so no query for it).
    ``client_ids``: the ids a protocol face's client gave the messages, in order (may be shorter).
    """
    now = utcnow()
    if not locked:
        # Lock the conversation row first, so that concurrent appends cannot take the same seq.
        touched = await session.execute(_TOUCH_CONVERSATION, {"b_id": conversation_id, "updated_at": now})
        if not touched.rowcount:  # type: ignore[attr-defined]
            raise ConversationNotFoundError(conversation_id)
    if first_seq is None:
        last = await session.scalar(_LAST_SEQ, {"b_conversation": conversation_id})
        first_seq = 0 if last is None else last + 1
    await session.execute(
        insert(_messages),
        [
            {
                "conversation_id": conversation_id,
                "run_id": run_id,
                "seq": first_seq + offset,
                "parent_seq": parent_seq if offset == 0 else first_seq + offset - 1,
                "role": message.role,
                "content": message.content,
                "tool_calls": [_stored_call(tc) for tc in message.tool_calls] or None,
                "tool_call_id": message.tool_call_id,
                "name": message.name,
                "pinned": message.pinned,
                "reasoning": message.reasoning,
                "created_at": now,
                "client_id": client_ids[offset] if offset < len(client_ids) else None,
            }
            for offset, message in enumerate(messages)
        ],
    )
    last_seq = first_seq + len(messages) - 1
    if head_from != "stay":
        await _move_head(session, conversation_id, last_seq, head_from)
    return last_seq


async def _lock_conversation(session: AsyncSession, conversation_id: str) -> int | None:
    """Lock the conversation's row (mark it updated) in the caller's transaction; its head's seq.
    Raises ``ConversationNotFoundError`` if it is gone."""
    params = {"b_id": conversation_id, "updated_at": utcnow()}
    row = (await session.execute(_LOCK_CONVERSATION, params)).first()
    if row is None:
        raise ConversationNotFoundError(conversation_id)
    head: int | None = row.head_seq
    return head


async def _move_head(
    session: AsyncSession, conversation_id: str, head: int | None, head_from: int | Literal["any"] | None
) -> None:
    """Make ``head`` the conversation's current leaf, if its head is ``head_from`` (or ``"any"``)."""
    if head_from == "any":
        await session.execute(_MOVE_HEAD, {"b_id": conversation_id, "b_head": head})
    elif head_from is None:
        await session.execute(_MOVE_HEAD_FROM_NONE, {"b_id": conversation_id, "b_head": head})
    else:
        await session.execute(_MOVE_HEAD_FROM, {"b_id": conversation_id, "b_head": head, "b_from": head_from})


def _stored_call(call: ToolCall) -> dict[str, Any]:
    stored: dict[str, Any] = {"id": call.id, "name": call.name, "arguments": call.arguments}
    if call.extra:
        stored["extra"] = dict(call.extra)
    return stored


async def _messages_of(session: AsyncSession, conversation_id: str) -> list[MessageRecord]:
    """Every message of the conversation, every branch, in the order they were stored."""
    return [
        _message_record(row) for row in await session.execute(_HISTORY, {"b_conversation": conversation_id})
    ]


def path_to(records: Sequence[MessageRecord], leaf_seq: int | None) -> list[MessageRecord]:
    """The messages from the root of the tree down to ``leaf_seq`` (nothing for None), in order."""
    if leaf_seq is None:
        return []
    by_seq = {record.seq: record for record in records}
    path: list[MessageRecord] = []
    seq: int | None = leaf_seq
    while seq is not None:
        record = by_seq.get(seq)
        if record is None or len(path) > len(by_seq):
            break  # a parent that is gone, or a loop no write makes: the path ends there
        path.append(record)
        seq = record.parent_seq
    path.reverse()
    return path


def next_seq(records: Sequence[MessageRecord]) -> int:
    return records[-1].seq + 1 if records else 0


async def _delete_follow_ups(session: AsyncSession, conversation_id: str, through: int) -> None:
    """Delete the follow-ups a run took (ids up to ``through``), in the caller's transaction: with
    the checkpoint, or the close, that records them taken."""
    await session.execute(
        delete(FollowUp).where(FollowUp.conversation_id == conversation_id, FollowUp.id <= through)
    )


def follow_up_messages(contents: Sequence[str]) -> list[ChatMessage]:
    """Follow-ups no loop took in, kept as pinned user messages so the next run sees them."""
    return [ChatMessage(role="user", content=c, pinned=True) for c in contents]


def _insert_for(session: AsyncSession) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_nothing``."""
    return _dialect_insert(session.get_bind().dialect)


def _dialect_insert(dialect: Dialect) -> Any:
    return pg_insert if dialect.name == "postgresql" else sqlite_insert


EVENT_COLUMNS = ("conversation_id", "cursor_ms", "cursor_seq", "run_id", "id", "event", "data")
"""The columns of an event row, in the order of ``event_values``."""
EventValues = tuple[str, int, int, str, str, str, str]
_EVENT_INSERTS: dict[tuple[str, str, str], str | None] = {}


def event_values(conversation_id: str, stored: StoredEvent) -> EventValues:
    """An event row as ``EVENT_COLUMNS``, for ``insert_event_values``."""
    ms, seq = _event_cursor(stored.id)
    return (conversation_id, ms, seq, stored.run_id, stored.id, stored.event, stored.data)


def _event_row(conversation_id: str, stored: StoredEvent) -> dict[str, Any]:
    """An event row as the ORM's statements take it (``_insert_events``)."""
    return dict(zip(EVENT_COLUMNS, event_values(conversation_id, stored), strict=True))


def _event_insert_sql(dialect: Dialect) -> str | None:
    """``INSERT INTO run_events ... ON CONFLICT DO NOTHING`` in ``dialect``'s own SQL, its
    parameters in the order of ``EVENT_COLUMNS``, compiled once per dialect and driver; None for
    a driver whose parameters are named (psycopg's ``pyformat``), which gets the ORM's statement."""
    key = (dialect.name, dialect.driver, dialect.paramstyle)
    if key not in _EVENT_INSERTS:
        statement = _dialect_insert(dialect)(_events).on_conflict_do_nothing()
        compiled = statement.compile(dialect=dialect, column_keys=EVENT_COLUMNS)
        positional = tuple(compiled.positiontup or ()) == EVENT_COLUMNS
        _EVENT_INSERTS[key] = str(compiled) if positional else None
    return _EVENT_INSERTS[key]


async def insert_event_values(session: AsyncSession, values: list[EventValues]) -> None:
    """Insert event rows (``event_values``) in the caller's transaction, skipping ids already
    stored: one ``executemany`` at the driver, for the event store's group commits. Through the
    ORM's statement, SQLAlchemy built and checked every row's parameters in Python, for every
    token of every run: 4 % of a streaming worker's instructions (bench/instructions.py)."""
    connection = await session.connection()
    sql = _event_insert_sql(connection.dialect)
    if sql is None:
        await _insert_events(session, [dict(zip(EVENT_COLUMNS, row, strict=True)) for row in values])
    else:
        await connection.exec_driver_sql(sql, values)


async def _insert_events(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """Insert event rows in the caller's transaction, skipping ids already stored; how many were new
    (exact for one row; executemany may not count)."""
    result = await session.execute(_insert_for(session)(_events).on_conflict_do_nothing(), rows)
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
