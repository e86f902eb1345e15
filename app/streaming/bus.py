"""The event bus interface, the event record every reader sees, and conversation cursors.

A cursor is ``"<ms>-<seq>"`` (the Redis Stream entry id format) and increases within a
conversation. The publisher of a conversation (only one run is active per conversation) assigns
ids itself, so the same id is written to the bus and to the database, and ids stay increasing
even if Redis restarts empty.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

ZERO_CURSOR = "0-0"


@functools.lru_cache(maxsize=8192)
def parse_cursor(cursor: str) -> tuple[int, int]:
    """``"ms-seq"`` -> ``(ms, seq)``; raises ``ValueError`` on anything else.

    Remembers the last few thousand: on its way from the publisher to a client an event's id is
    compared about nine times (the publisher, the bus's fan-out, each follower, the resume), and
    parsing it anew each time was the largest single cost of the delivery path (bench/NOTES.md)."""
    ms, sep, seq = cursor.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit() or len(ms) > 20 or len(seq) > 20:
        raise ValueError(f"invalid cursor {cursor!r}")
    return int(ms), int(seq)


def format_cursor(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def later_cursor(a: str | None, b: str | None) -> str:
    """The later of two cursors, either of which may be missing (``ZERO_CURSOR`` if both are)."""
    if a is None:
        return b or ZERO_CURSOR
    if b is None:
        return a
    return a if parse_cursor(a) >= parse_cursor(b) else b


def next_cursor(last: str | None, now_ms: int) -> str:
    """The smallest cursor after ``last`` that is not earlier than ``now_ms``."""
    if last is None:
        return format_cursor(now_ms, 0)
    ms, seq = parse_cursor(last)
    if now_ms > ms:
        return format_cursor(now_ms, 0)
    return format_cursor(ms, seq + 1)


class EventBusError(Exception):
    """Base of the bus errors below."""


class BusUnavailableError(EventBusError):
    """The bus cannot be reached right now (e.g. Redis restarting); the caller may retry."""


class BusClosedError(EventBusError):
    """The bus was closed (the process is shutting down); retrying is pointless."""


class EventOrderError(EventBusError):
    """An appended id is not greater than the newest id the bus holds (e.g. another writer)."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One event as every reader sees it: live, replayed or from the database.

    ``data`` is the JSON text of the payload (it carries ``run_id``), encoded once by the publisher.
    ``prev`` is the id of the conversation's event right before this one, as its publisher knew it:
    the bus carries it so that a reader can tell from the bus alone that nothing lies between its
    cursor and an entry (``app.streaming.resume``). The database does not store it (it holds every
    event anyway), so it takes no part in equality; None where unknown.
    """

    id: str
    event: str
    data: str
    run_id: str
    prev: str | None = field(default=None, compare=False)

    @property
    def is_done(self) -> bool:
        return self.event == "done"


class EventBus(Protocol):
    async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        """Append events (ids already assigned, increasing) in one round trip.

        Raises ``EventOrderError`` if an id is not greater than the newest one held, and
        ``BusUnavailableError`` if the bus cannot be reached (some events may have been appended).
        """
        ...

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        """Events with id > ``after`` that the bus still holds, oldest first."""
        ...

    async def oldest_id(self, conversation_id: str) -> str | None:
        """Id of the oldest event the bus still holds for the conversation, None if it holds none."""
        ...

    async def last_id(self, conversation_id: str) -> str | None: ...

    def follow(self, conversation_id: str, after: str) -> AsyncIterator[StoredEvent]:
        """Events with id > ``after`` as they are appended (replay what is held, then live).

        Never ends by itself. Raises ``BusUnavailableError`` when it cannot vouch that nothing was
        lost (the bus was unreachable too long, or came back without the events after ``after``):
        the caller re-checks against the database (``app.streaming.resume``). Raises
        ``BusClosedError`` once the bus is closed.
        """
        ...

    async def expire(self, conversation_id: str, seconds: int) -> None:
        """Forget the conversation's events ``seconds`` from now (called after ``done``)."""
        ...

    async def delete(self, conversation_id: str) -> None: ...

    async def ping(self) -> bool:
        """True if the bus is reachable (``/readyz``); never raises."""
        ...

    async def close(self) -> None: ...
