"""Errors the persistence layer raises; the API maps them to HTTP status codes in one place."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError


class PersistenceError(Exception):
    """Base of every error ``app.db`` raises on purpose."""


class RunActiveError(PersistenceError):
    """A run of the conversation is already running (only one may run at a time)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"a run of conversation {conversation_id} is already running")
        self.conversation_id = conversation_id


class ConversationNotFoundError(PersistenceError):
    """The conversation does not exist (or was deleted meanwhile)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} not found")
        self.conversation_id = conversation_id


class EventIdTakenError(PersistenceError):
    """An event with this id is already stored (another process took it in the same millisecond);
    nothing of the transaction was kept, so the caller may retry under a new id."""

    def __init__(self, event_id: str) -> None:
        super().__init__(f"event id {event_id} is already taken")
        self.event_id = event_id


class InvalidCursorError(PersistenceError, ValueError):
    """A pagination or event cursor that this service did not hand out."""


def database_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached (down, restarting, connection cut),
    so that the same statement may well succeed once it is back."""
    if isinstance(exc, (OSError, InterfaceError, OperationalError, PoolTimeoutError)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


class FollowUpLimitError(PersistenceError):
    """The conversation already holds its most untaken follow-ups; nothing was stored."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} follow-ups are already waiting")
        self.limit = limit


class QueueFullError(PersistenceError):
    """``MAX_QUEUED_RUNS`` runs already wait (RUNS.md Q-02); nothing was stored."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the run queue is full ({limit} runs wait); retry later")
        self.limit = limit
