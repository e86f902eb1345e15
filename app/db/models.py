"""The SQLAlchemy tables: conversations, their messages, runs with their checkpoints and follow-ups,
the durable copy of run events, what the built-in tools keep (notes, effects), and the webhooks'
outbox with the A2A push notification configs.

Constraint names come from one naming convention so that migrations can address them on every
dialect. Datetimes are stored in UTC and always come back timezone-aware, SQLite included.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RUN_STATUSES = ("queued", "running", "waiting", "completed", "failed", "cancelled")
ACTIVE_STATUSES = ("queued", "running", "waiting")
"""A conversation's active run is in one of these: at most one at a time."""

# The same predicate for both dialects: it is what makes "one active run per conversation" a
# database guarantee rather than a check-then-insert race.
ACTIVE_PREDICATE = text("status IN ('queued', 'running', 'waiting')")

APPROVAL_STATUSES = ("pending", "approved", "denied", "expired", "cancelled", "answered")
APPROVAL_KINDS = ("approval", "client")
"""What a row of ``approvals`` waits for: a person's decision, or the result of a tool the client
runs (FACES.md C-02, status ``answered`` once it came)."""


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that refuses naive values and always returns aware UTC ones.

    SQLite has no time zone type and hands back naive datetimes; storing UTC and re-attaching it
    on the way out makes both dialects behave the same.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


_SURROGATE = re.compile("[\ud800-\udfff]")


class StoredText(TypeDecorator[str]):
    """``Text`` that any database takes: NUL (PostgreSQL refuses it in text) becomes U+FFFD, and so
    does a lone surrogate (no UTF-8 encoding has one). Models and tools can return either; a run
    whose answer or tool result could not be stored would never be closed."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode()
        except UnicodeEncodeError:
            value = _SURROGATE.sub("\ufffd", value)
        return value


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class Conversation(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200), index=True)
    title: Mapped[str] = mapped_column(StoredText)
    agent_config: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    head_seq: Mapped[int | None] = mapped_column(Integer)
    """The current leaf of the conversation's tree of messages (its ``seq``; FACES.md B-01): what
    ``GET /api/conversations/{id}`` shows is the path from the root to it. Null: no message yet."""


class Message(Base):
    """One message of a conversation's tree (FACES.md B-01).

    ``seq`` numbers a conversation's messages in the order they were stored; ``parent_seq`` is the
    ``seq`` of the message it follows (null for a first message). A run's messages hang one below
    the other from its question; an edit, a regenerate or a replay starts a sibling branch.
    """

    __tablename__ = "messages"
    # The unique (conversation_id, seq) index also serves every "messages of a conversation in
    # order" query, so conversation_id needs no index of its own.
    __table_args__ = (UniqueConstraint("conversation_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"))
    run_id: Mapped[str | None] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str | None] = mapped_column(StoredText)
    # SQL NULL for "no tool calls", not the JSON literal null.
    tool_calls: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    tool_call_id: Mapped[str | None] = mapped_column(String(200))
    name: Mapped[str | None] = mapped_column(String(200))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The thinking a provider returned with an assistant message; some providers refuse the next
    # request unless it is sent back (app.llm.providers).
    reasoning: Mapped[str | None] = mapped_column(StoredText)
    parent_seq: Mapped[int | None] = mapped_column(Integer)
    client_id: Mapped[str | None] = mapped_column(String(200))
    """The id a protocol face's client gave the message it sent (FACES.md V-02, G-02)."""


class FaceThread(Base):
    """An owner's client-side id of a chat (AI SDK), a thread (AG-UI) or a context (A2A), and the
    conversation it names (FACES.md V-02, G-02): created at the id's first use."""

    __tablename__ = "face_threads"

    owner: Mapped[str] = mapped_column(String(200), primary_key=True)
    face: Mapped[str] = mapped_column(String(16), primary_key=True)
    client_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(
            "status IN ('queued', 'running', 'waiting', 'completed', 'failed', 'cancelled')",
            name="status",
        ),
        Index(
            "ux_runs_one_active_per_conversation",
            "conversation_id",
            unique=True,
            sqlite_where=ACTIVE_PREDICATE,
            postgresql_where=ACTIVE_PREDICATE,
        ),
        # The run queue in order (RUNS.md Q-01), and an owner's running runs (its cap).
        Index("ix_runs_status_created_at", "status", "created_at"),
        Index("ix_runs_owner_status", "owner", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    owner: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(StoredText)
    answer: Mapped[str | None] = mapped_column(StoredText)
    iterations: Mapped[int] = mapped_column(Integer, default=0)
    usage: Mapped[dict[str, Any]]
    elapsed: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(StoredText)
    pending_injections: Mapped[list[Any]]
    start_cursor: Mapped[str] = mapped_column(String(64))
    worker_id: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    # Durable runs (RUNS.md ): the attempt that holds the run now (1 for the
    # first), how many attempts died (a clean hand-over does not count), and a cancel asked for
    # while no worker held the run.
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    lost_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The configured model the run is bound to for every call (E-02; LLM_MODELS' name), and the
    # trace its spans belong to (null without tracing). Null for runs older than models.
    model: Mapped[str | None] = mapped_column(String(100))
    trace_id: Mapped[str | None] = mapped_column(String(32))
    # The request that started it, as a W3C traceparent: the parent of every attempt's span.
    trace_parent: Mapped[str | None] = mapped_column(String(55))
    # Its question's place in the conversation's tree (FACES.md B-01): the run's history is the
    # path to it, and what the run adds hangs below it. Several runs share one question when it
    # was answered again (regenerate, replay).
    question_seq: Mapped[int | None] = mapped_column(Integer)
    # Tools the client runs declared for this run alone, beside the conversation's (C-01).
    client_tools: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    # The run this one replays from one of its checkpoints (B-06).
    replay_of: Mapped[str | None] = mapped_column(String(64))
    # Where the run record is posted when the run starts waiting and when it ends (N-07).
    webhook: Mapped[str | None] = mapped_column(Text)


class RunEvent(Base):
    __tablename__ = "run_events"

    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    cursor_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    cursor_seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    id: Mapped[str] = mapped_column(String(64))
    event: Mapped[str] = mapped_column(String(32))
    # Text, not JSON: the payload is kept byte-for-byte as the publisher encoded it, so that
    # replayed events are identical to live ones.
    data: Mapped[str] = mapped_column(Text)


class Checkpoint(Base):
    """One checkpoint of a run (RUNS.md R-01): what changed since the previous one, as JSON text.

    Keyed by the attempt that wrote it: a new attempt stores the whole state it starts from as its
    first checkpoint (seq 0) and reads only its own rows after that, so an attempt that lost the
    run but still writes (a worker that stalled past its lease) cannot mix into its successor's.
    """

    __tablename__ = "run_checkpoints"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    after: Mapped[str | None] = mapped_column(String(64))
    """The id of the last event published before the checkpoint: what it covers."""
    data: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class FollowUp(Base):
    """A follow-up a user posted to a conversation's active run, until the run closes (E-22).

    The run takes them in order (``id``) and its checkpoints say how far it got, so none is lost or
    taken twice when the run moves to another worker.
    """

    __tablename__ = "follow_ups"
    # AUTOINCREMENT on SQLite: an id is never used again after the rows before it were deleted
    # (a run's position says "taken up to here").
    __table_args__ = (
        Index("ix_follow_ups_conversation_id_id", "conversation_id", "id"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"))
    content: Mapped[str] = mapped_column(StoredText)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Note(Base):
    """The notebook tool's notes (RUNS.md R-12), one set per owner, by title."""

    __tablename__ = "notes"

    owner: Mapped[str] = mapped_column(String(200), primary_key=True)
    title: Mapped[str] = mapped_column(String(200), primary_key=True)
    content: Mapped[str] = mapped_column(StoredText)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class ToolEffect(Base):
    """The result of a tool call that changed something, by its idempotency key (RUNS.md R-05):
    the same call made again returns this result and changes nothing more."""

    __tablename__ = "tool_effects"

    idempotency_key: Mapped[str] = mapped_column(String(300), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    result: Mapped[str] = mapped_column(StoredText)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class Approval(Base):
    """A tool call that waits for a person's decision (RUNS.md A-01..A-06), or, of ``kind``
    ``client``, for its result from the client that runs the tool (FACES.md C-02, C-03).

    Its id is made from the run and the call (``app.runs.approvals.approval_id``), so a new
    attempt that asks again for the same call finds the same row. ``tool_args`` are the arguments
    the call asked for; ``decided_args`` the ones that run (edited by the person, or the same).
    """

    __tablename__ = "approvals"
    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'approved', 'denied', 'expired', 'cancelled', 'answered')",
            name="status",
        ),
        Index("ix_approvals_owner_status_created_at", "owner", "status", "created_at"),
        Index("ix_approvals_status_expires_at", "status", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    owner: Mapped[str] = mapped_column(String(200))
    call_id: Mapped[str] = mapped_column(String(200))
    tool_name: Mapped[str] = mapped_column(String(200))
    tool_args: Mapped[dict[str, Any]]
    iteration: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(StoredText)
    decided_args: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    decided_by: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    decided_at: Mapped[datetime | None]
    kind: Mapped[str] = mapped_column(String(16), default="approval", server_default="approval")
    output: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    """A client call's result as it came: ``{"output": any}`` or ``{"error": str}``."""


PENDING_DELIVERY = text("delivered_at IS NULL AND given_up_at IS NULL")
"""A delivery of the outbox that is neither made nor given up: due at ``next_attempt_at``."""
DELIVERED = text("delivered_at IS NOT NULL")
GIVEN_UP = text("given_up_at IS NOT NULL")


class WebhookDelivery(Base):
    """One POST the service owes a receiver (FACES.md N-06, N-07): the durable outbox.

    Stored in the transaction that made the change it tells of, so that it survives the worker
    that stored it and Redis. Any worker claims it when due (``claimed_by``, ``claimed_until``: a
    lease, so the claims of a worker that died come back), makes the attempt, and records the
    outcome; ``id`` is the delivery's ``webhook-id``, the same on every attempt. No foreign key to
    the run: the body is whole, and what is owed is still owed when the conversation is deleted.
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            sqlite_where=PENDING_DELIVERY,
            postgresql_where=PENDING_DELIVERY,
        ),
        # What pruning deletes: made or given up long ago (``Outbox.prune``, one index each).
        Index(
            "ix_webhook_deliveries_delivered_at",
            "delivered_at",
            sqlite_where=DELIVERED,
            postgresql_where=DELIVERED,
        ),
        Index(
            "ix_webhook_deliveries_given_up_at",
            "given_up_at",
            sqlite_where=GIVEN_UP,
            postgresql_where=GIVEN_UP,
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    """``run`` (a run webhook, N-07) or ``a2a_push`` (an A2A push notification, N-06)."""
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    event: Mapped[str] = mapped_column(String(32))
    """What it tells: the run's status then (``waiting``, ``completed``, ...)."""
    url: Mapped[str] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(Text)
    """The URL's host name, lower case: a worker makes only a few attempts at once per host. None
    on rows queued before revision 0011 (or by a worker of the version before it)."""
    headers: Mapped[dict[str, Any]]
    """Headers of its own (an A2A config's ``Authorization``): a secret, never logged."""
    body: Mapped[str] = mapped_column(Text)
    """The JSON posted, exactly these bytes (UTF-8) on every attempt."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    next_attempt_at: Mapped[datetime]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """Attempts claimed so far (the one under way included): an attempt's number fences its outcome."""
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    claimed_until: Mapped[datetime | None]
    delivered_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    """Why the last attempt failed, in words that hold no secret (no URL, header or body)."""
    given_up_at: Mapped[datetime | None]


class PushConfig(Base):
    """An A2A push notification config of a task (FACES.md N-06): where the service posts the
    task's status changes, with what credentials. ``config_id`` is the A2A config's ``id``, unique
    per task; the row goes with its run."""

    __tablename__ = "push_configs"
    __table_args__ = (UniqueConstraint("run_id", "config_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    owner: Mapped[str] = mapped_column(String(200))
    config_id: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(Text)
    token: Mapped[str | None] = mapped_column(Text)
    authentication: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    """The A2A ``AuthenticationInfo``: ``{"scheme", "credentials"}``."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
