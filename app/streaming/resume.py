"""Resuming a conversation's stream from a cursor: the bus when it can vouch, else the database.

``stream_events`` yields every event after the cursor exactly once, in order, and stops after the
first ``done``. The bus holds a conversation's recent events only (they expire after a run, Redis
may restart empty, a stream may be trimmed), so before following the bus it checks that the bus
still holds the events right after the cursor; when it does not, it serves them from the database
until caught up, and only then goes back to the bus. Never a silent gap.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Protocol

from app.streaming.bus import BusClosedError, BusUnavailableError, EventBus, StoredEvent, parse_cursor

log = logging.getLogger("app.streaming.resume")

PAGE = 500


class EventStoreReader(Protocol):
    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        """Up to ``limit`` stored events with an id greater than ``after``, oldest first."""
        ...


async def stream_events(
    bus: EventBus,
    store: EventStoreReader,
    conversation_id: str,
    after: str,
    *,
    outage_poll_s: float = 1.0,
    seam_wait_s: float = 0.0,
) -> AsyncIterator[StoredEvent]:
    """Every event of the conversation with id > ``after``, in order, once; ends after ``done``.

    While the bus is unreachable, events are served from the database, polled every
    ``outage_poll_s``. Ends quietly when the bus is closed (the worker is shutting down): the
    client reconnects with its cursor.

    ``seam_wait_s``: when the bus starts later than the cursor, how long to wait for the database
    to catch up with the bus's first event before trusting that nothing lies in between. The
    database lags the bus by a batch interval, so without a wait a reconnect right after Redis
    lost events could skip those the database has not written yet.
    """
    last = after
    attempt = 0
    while True:
        from_store = False
        try:
            continuous = await _bus_continues(bus, store, conversation_id, parse_cursor(last))
            if continuous is None:
                # The database holds events the bus lost: serve a page of them, then look again.
                from_store = True
            else:
                follow = bus.follow(conversation_id, last)
                try:
                    if not continuous:
                        # The bus starts later than `last`: check the seam against the database once.
                        first = await anext(follow)
                        first_key = parse_cursor(first.id)
                        if await _store_has_between(store, conversation_id, last, first_key, seam_wait_s):
                            continue  # the bus skipped events the database has: look again
                        yield first
                        last = first.id
                        if first.is_done:
                            return
                    attempt = 0
                    # follow() yields ids > `last`, increasing, each once: no need to compare here.
                    async for event in follow:
                        yield event
                        last = event.id
                        if event.is_done:
                            return
                finally:
                    # Leaving a follow early must unsubscribe now, not when the generator is collected.
                    aclose = getattr(follow, "aclose", None)
                    if aclose is not None:
                        await aclose()
        except BusClosedError:
            return
        except BusUnavailableError as exc:
            log.info(
                "event bus unavailable; serving from the database",
                extra={"conversation_id": conversation_id, "error": str(exc)},
            )
            from_store = True
        if not from_store:
            continue
        page = await _store_page(store, conversation_id, last)
        for event in page:
            yield event
            last = event.id
            if event.is_done:
                return
        if not page:  # nothing new (deleted, or the database is behind): do not spin
            attempt += 1
            await asyncio.sleep(_backoff(attempt, outage_poll_s))


async def _store_page(store: EventStoreReader, conversation_id: str, last: str) -> list[StoredEvent]:
    """The database's next events after ``last``, strictly increasing."""
    last_key = parse_cursor(last)
    page: list[StoredEvent] = []
    for event in await store.read_after(conversation_id, last, PAGE):
        key = parse_cursor(event.id)
        if key > last_key:
            page.append(event)
            last_key = key
    return page


def _backoff(attempt: int, cap: float) -> float:
    return min(cap, 0.05 * 2.0**attempt) * (0.5 + random.random() / 2)


async def _bus_continues(
    bus: EventBus, store: EventStoreReader, conversation_id: str, last_key: tuple[int, int]
) -> bool | None:
    """Whether the bus holds what comes right after ``last_key``.

    True: it holds an event at or before ``last_key``, so nothing after it is missing (streams are
    only ever cut from the front), or the database's next event is the bus's oldest. False: the bus
    starts later but the database has nothing after ``last_key`` yet (the caller re-checks the
    seam on the first live event). None: the database holds events after ``last_key`` that the
    bus does not.
    """
    oldest = await bus.oldest_id(conversation_id)
    if oldest is not None and parse_cursor(oldest) <= last_key:
        return True
    last = f"{last_key[0]}-{last_key[1]}"
    stored = await store.read_after(conversation_id, last, 1)
    if not stored:
        return False
    if oldest is None or parse_cursor(stored[0].id) < parse_cursor(oldest):
        return None
    # The database's next event is the bus's oldest: the bus continues right after `last`.
    return stored[0].id == oldest


async def _store_has_between(
    store: EventStoreReader, conversation_id: str, last: str, key: tuple[int, int], wait_s: float
) -> bool:
    """Whether the database holds an event after ``last`` and before the bus's ``key``.

    The publisher queues every event for the database before it sends it to the bus, and the
    database stores them in order: once it holds anything after ``last``, its first such event
    settles the question. Until then wait up to ``wait_s`` (a database that stopped storing must
    not stall the stream forever).
    """
    deadline = time.monotonic() + wait_s
    pause = 0.005
    while True:
        stored = await store.read_after(conversation_id, last, 1)
        if stored:
            return parse_cursor(stored[0].id) < key
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)
