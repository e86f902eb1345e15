"""Resuming a conversation's stream from a cursor: the bus when it can vouch, else the database.

``stream_events`` yields every event after the cursor exactly once, in order, and stops after the
first ``done``. The bus holds a conversation's recent events only (they expire after a run, Redis
may restart empty, a stream may be trimmed or deleted), so every entry it yields is checked to
come right after the last one yielded (its ``prev``); where it does not, the database serves what
lies between until caught up, and only then the bus is followed again. Never a silent gap.
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

    Each bus entry names the event before it (``StoredEvent.prev``), so an entry whose ``prev`` is
    at or before the cursor proves that nothing lies in between, from the bus alone; an entry whose
    ``prev`` is later shows a hole (Redis restarted empty, a trimmed or deleted stream), which the
    database fills. While the bus is unreachable, events are served from the database, polled every
    ``outage_poll_s``. Ends quietly when the bus is closed (the worker is shutting down): the
    client reconnects with its cursor.

    ``seam_wait_s``: at a hole, or at an entry that does not name its predecessor (written by an
    earlier version) and starts later than the cursor, how long to wait for the database to store
    the events before it. The database lags the bus by a batch interval, so without a wait a
    reconnect right after Redis lost events could skip those the database has not written yet.
    """
    last = after
    attempt = 0
    while True:
        from_store = False
        try:
            if await _store_is_ahead(bus, store, conversation_id, last):
                from_store = True
            else:
                follow = bus.follow(conversation_id, last)
                try:
                    vouched = False  # for entries without `prev`: continuity checked once per follow
                    # follow() yields ids > `last`, increasing, each once: no need to compare here.
                    async for event in follow:
                        # An entry naming the last event yielded continues it (the rule, checked
                        # without parsing either).
                        if (
                            not vouched
                            and event.prev != last
                            and not await _continues(bus, store, conversation_id, last, event, seam_wait_s)
                        ):
                            from_store = True  # the database holds events the bus skipped
                            break
                        vouched = event.prev is None
                        yield event
                        last = event.id
                        attempt = 0
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


async def _store_is_ahead(bus: EventBus, store: EventStoreReader, conversation_id: str, last: str) -> bool:
    """Whether the database holds events after ``last`` while the bus holds none.

    Then nothing on the bus would ever show the hole (a finished run whose stream expired, or
    Redis restarted empty): the database serves them. The database is asked only when the bus
    holds nothing after ``last``: a new stream waiting for its run's first event, mostly.
    """
    newest = await bus.last_id(conversation_id)
    if newest is not None and parse_cursor(newest) > parse_cursor(last):
        return False
    try:
        return bool(await store.read_after(conversation_id, last, 1))
    except Exception as exc:
        # The database is away: follow the bus, which shows any hole by its entries' ``prev``.
        # (A database ahead of the bus is the rule with an in-process bus: it gets every event
        # first.)
        log.info(
            "database unreachable; following the bus",
            extra={"conversation_id": conversation_id, "error": repr(exc)},
        )
        return False


async def _continues(
    bus: EventBus,
    store: EventStoreReader,
    conversation_id: str,
    last: str,
    event: StoredEvent,
    seam_wait_s: float,
) -> bool:
    """Whether ``event``, the bus's next entry after ``last``, comes right after it.

    False when the database holds an event in between: the caller serves those first.
    """
    last_key = parse_cursor(last)
    if event.prev is not None:
        if parse_cursor(event.prev) <= last_key:
            return True
    else:
        # No `prev` (an entry of an earlier version): the bus vouches only if it still holds an
        # entry at or before `last` (streams are only ever cut from the front).
        oldest = await bus.oldest_id(conversation_id)
        if oldest is not None and parse_cursor(oldest) <= last_key:
            return True
    if await _store_has_between(store, conversation_id, last, parse_cursor(event.id), seam_wait_s):
        return False
    if event.prev is not None:
        log.warning(
            "events lost: neither the bus nor the database holds them",
            extra={"conversation_id": conversation_id, "after": last, "before": event.id},
        )
    return True


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
        pause = min(pause * 2, 0.25)  # quick while the lag is a store interval, gentle in an outage
