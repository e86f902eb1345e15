"""``MemoryEventBus``: the in-process event bus used when no Redis is configured.

Each conversation has one append-only log. A follower keeps nothing but its position in that log
(the id of the last event it yielded), so replay and live delivery are the same read and no
follower can make memory grow, however slow it is.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right
from collections.abc import AsyncIterator, Sequence

from app.streaming.bus import BusClosedError, EventOrderError, StoredEvent, parse_cursor


class _Log:
    """One conversation's events, oldest first, with a wake-up for the followers waiting on it."""

    __slots__ = ("changed", "dropped", "events", "expiry", "explicit_expiry", "followers", "keys", "touched")

    def __init__(self) -> None:
        self.events: list[StoredEvent] = []
        self.keys: list[tuple[int, int]] = []
        self.changed = asyncio.Event()
        self.followers = 0
        self.dropped = False
        self.expiry: asyncio.TimerHandle | None = None
        self.explicit_expiry = False
        self.touched = time.monotonic()

    def wake(self) -> None:
        # A fresh Event per generation: waiters of the old one all wake, new waiters wait anew.
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def after(self, key: tuple[int, int], limit: int) -> list[StoredEvent]:
        start = bisect_right(self.keys, key)
        return self.events[start : start + limit]

    def cancel_expiry(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None


class MemoryEventBus:
    """In-process ``EventBus`` for a single worker.

    A conversation's events are dropped ``retention_s`` after its last append (a safety net for a
    run that never ends), or earlier when ``expire()`` says so; a new append cancels a pending
    ``expire()``, since a new run has started. A conversation keeps at most about ``maxlen``
    events, as the Redis bus's streams do: one whose runs follow each other closely never expires.
    Events dropped here are still in the database, and readers see the gap (``prev``).
    """

    def __init__(self, retention_s: float = 600, maxlen: int | None = 100_000) -> None:
        self._retention_s = retention_s
        self._maxlen = maxlen
        self._logs: dict[str, _Log] = {}
        self._closed = False

    # ---- writing ---------------------------------------------------------------------------

    async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        self._check_open()
        if not events:
            return
        log = self._log(conversation_id)
        keys = [parse_cursor(e.id) for e in events]
        previous = log.keys[-1] if log.keys else None
        for event, key in zip(events, keys, strict=True):
            if previous is not None and key <= previous:
                raise EventOrderError(
                    f"event id {event.id} is not greater than the newest id held for {conversation_id}"
                )
            previous = key
        log.events.extend(events)
        log.keys.extend(keys)
        if self._maxlen is not None and len(log.events) > self._maxlen + self._maxlen // 8:
            # Trimmed in steps, not per append: the oldest eighth goes at once.
            del log.events[: len(log.events) - self._maxlen]
            del log.keys[: len(log.keys) - self._maxlen]
        log.touched = time.monotonic()
        if log.explicit_expiry:
            log.cancel_expiry()
            log.explicit_expiry = False
        if log.expiry is None:
            self._schedule(conversation_id, log, self._retention_s)
        log.wake()

    async def expire(self, conversation_id: str, seconds: int) -> None:
        self._check_open()
        log = self._logs.get(conversation_id)
        if log is None:
            return
        log.cancel_expiry()
        log.explicit_expiry = True
        self._schedule(conversation_id, log, max(0.0, float(seconds)))

    async def delete(self, conversation_id: str) -> None:
        self._check_open()
        self._drop(conversation_id)

    # ---- reading ---------------------------------------------------------------------------

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        self._check_open()
        log = self._logs.get(conversation_id)
        if log is None:
            return []
        return log.after(parse_cursor(after), limit)

    async def oldest_id(self, conversation_id: str) -> str | None:
        self._check_open()
        log = self._logs.get(conversation_id)
        return log.events[0].id if log is not None and log.events else None

    async def last_id(self, conversation_id: str) -> str | None:
        self._check_open()
        log = self._logs.get(conversation_id)
        return log.events[-1].id if log is not None and log.events else None

    async def follow(self, conversation_id: str, after: str) -> AsyncIterator[StoredEvent]:
        self._check_open()
        position = parse_cursor(after)
        log = self._log(conversation_id)
        log.followers += 1
        try:
            while True:
                if log.dropped:
                    # Expired or deleted while we waited: continue on whatever log replaces it.
                    log.followers -= 1
                    log = self._log(conversation_id)
                    log.followers += 1
                batch = log.after(position, 256)
                if batch:
                    for event in batch:
                        yield event
                    position = parse_cursor(batch[-1].id)
                    continue
                self._check_open()
                await log.changed.wait()
        finally:
            log.followers -= 1
            if not log.dropped and log.followers == 0 and not log.events:
                self._drop(conversation_id)

    async def ping(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        self._closed = True
        for conversation_id in list(self._logs):
            self._drop(conversation_id)

    # ---- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosedError("the event bus is closed")

    def _log(self, conversation_id: str) -> _Log:
        log = self._logs.get(conversation_id)
        if log is None:
            log = self._logs[conversation_id] = _Log()
        return log

    def _schedule(self, conversation_id: str, log: _Log, delay: float) -> None:
        loop = asyncio.get_running_loop()
        log.expiry = loop.call_later(delay, self._on_expiry, conversation_id, log)

    def _on_expiry(self, conversation_id: str, log: _Log) -> None:
        log.expiry = None
        if log.dropped:
            return
        if not log.explicit_expiry:
            # Idle safety net: appends since the timer was set push the deadline back.
            remaining = log.touched + self._retention_s - time.monotonic()
            if remaining > 0:
                self._schedule(conversation_id, log, remaining)
                return
        if self._logs.get(conversation_id) is log:
            self._drop(conversation_id)

    def _drop(self, conversation_id: str) -> None:
        log = self._logs.pop(conversation_id, None)
        if log is None:
            return
        log.cancel_expiry()
        log.dropped = True
        log.wake()
