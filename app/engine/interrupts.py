"""The InterruptQueue: follow-up messages a user sends while a run works (E-22 to E-25).

The engine only needs ``drain()``; the service feeds ``put()``. ``MemoryInterruptQueue`` serves one
process; the Redis-backed queue in ``app.streaming`` crosses processes.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

INTERRUPT_MARKER = "[USER INTERRUPT]"

MAX_QUEUED = 100
"""Most follow-ups one conversation's queue holds until the run takes them (at its next safe point,
within one iteration). Unbounded, a client could queue without end: every message is held until the
drain, then sent to the model as one message."""


class InterruptQueueFullError(Exception):
    """``put()`` on a queue that already holds its most follow-ups; nothing was queued."""


@runtime_checkable
class InterruptQueue(Protocol):
    async def put(self, content: str) -> int:
        """Queue a message; returns how many are queued now. Raises ``InterruptQueueFullError``,
        queueing nothing, if ``MAX_QUEUED`` (or the queue's own limit) are waiting already."""
        ...

    async def drain(self) -> list[str]:
        """Take every queued message, oldest first, atomically.

        A queue may also have a ``position`` (how far it got, for a new attempt of the run to start
        from, as the service's durable queue does); the loop records it in its checkpoints."""
        ...


class MemoryInterruptQueue:
    def __init__(self, *, limit: int = MAX_QUEUED) -> None:
        self._items: list[str] = []
        self._lock = asyncio.Lock()
        self._limit = limit

    async def put(self, content: str) -> int:
        async with self._lock:
            if len(self._items) >= self._limit:
                raise InterruptQueueFullError(f"{self._limit} follow-ups are already waiting")
            self._items.append(content)
            return len(self._items)

    async def drain(self) -> list[str]:
        async with self._lock:
            items, self._items = self._items, []
            return items


def merge_interrupts(contents: list[str]) -> str:
    """All messages of one drain become ONE user message, marked, so the model sees them together."""
    if len(contents) == 1:
        return f"{INTERRUPT_MARKER} {contents[0]}"
    lines = "\n".join(f"{i}. {c}" for i, c in enumerate(contents, 1))
    return f"{INTERRUPT_MARKER} The user sent follow-up messages while you were working:\n{lines}"
