"""Test doubles for the transport: an in-memory event store and a bus that fails or stalls on cue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from app.streaming.bus import BusUnavailableError, StoredEvent, parse_cursor
from app.streaming.memory import MemoryEventBus


class StoreDownError(Exception):
    pass


class MemoryStore:
    """The ``EventRepo`` contract (save idempotent by id, read_after ordered) in a dict.

    ``fail_saves`` makes that many next ``save`` calls fail; ``saved_batches`` records the ids of
    every successful call, so a test can see an id stored twice.
    """

    def __init__(self) -> None:
        self.events: dict[str, dict[str, StoredEvent]] = {}
        self.fail_saves = 0
        self.failed_saves = 0
        self.saved_batches: list[list[str]] = []
        self.reads = 0

    async def save(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        if self.fail_saves:
            self.fail_saves -= 1
            self.failed_saves += 1
            raise StoreDownError("database is down")
        held = self.events.setdefault(conversation_id, {})
        new = [e for e in events if e.id not in held]
        for event in new:
            held[event.id] = event
        self.saved_batches.append([e.id for e in new])

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        self.reads += 1
        key = parse_cursor(after)
        held = sorted(self.events.get(conversation_id, {}).values(), key=lambda e: parse_cursor(e.id))
        return [e for e in held if parse_cursor(e.id) > key][:limit]

    def all(self, conversation_id: str) -> list[StoredEvent]:
        return sorted(self.events.get(conversation_id, {}).values(), key=lambda e: parse_cursor(e.id))


class ScriptedBus(MemoryEventBus):
    """A memory bus whose appends can be made to fail, to half-succeed, or to wait for a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.appends: list[list[StoredEvent]] = []
        self.fail_appends = 0
        self.partial_failure = False
        self.gate: asyncio.Event | None = None
        self.in_append = asyncio.Event()
        self.expired: list[tuple[str, int]] = []
        self.follow_error: Callable[[], BaseException] | None = None

    async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        self.in_append.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_appends:
            self.fail_appends -= 1
            if self.partial_failure and len(events) > 1:
                # The connection dropped after Redis took the first half.
                await super().append(conversation_id, events[: len(events) // 2])
            raise BusUnavailableError("redis is down")
        self.appends.append(list(events))
        await super().append(conversation_id, events)

    async def expire(self, conversation_id: str, seconds: int) -> None:
        self.expired.append((conversation_id, seconds))
        await super().expire(conversation_id, seconds)

    async def follow(self, conversation_id: str, after: str) -> AsyncIterator[StoredEvent]:
        if self.follow_error is not None:
            raise self.follow_error()
        async for event in super().follow(conversation_id, after):
            yield event


def stored(n: int, *, event: str = "step", run_id: str = "run_1", ms: int = 1000) -> StoredEvent:
    """The ``n``-th test event, id ``<ms+n>-0``."""
    return StoredEvent(f"{ms + n}-0", event, f'{{"n":{n},"run_id":"{run_id}"}}', run_id)


def done(n: int, *, run_id: str = "run_1", ms: int = 1000) -> StoredEvent:
    return StoredEvent(f"{ms + n}-0", "done", f'{{"n":{n},"status":"completed","run_id":"{run_id}"}}', run_id)


async def wait_until(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll ``predicate`` (yielding to the loop) until true; fail after ``within_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


def append_nowait(
    self: ScriptedBus, conversation_id: str, events: Sequence[StoredEvent]
) -> asyncio.Future[None]:
    """The Redis buses' ``append_nowait`` on a ``ScriptedBus`` (its failures, gate and records
    included): with it, ``RunPublisher`` sends an event itself when the run is idle."""
    self._check_open()
    return asyncio.ensure_future(self.append(conversation_id, list(events)))
