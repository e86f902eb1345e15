"""stream_events: every event after the cursor once, in order, from the bus or the database."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest

from app.streaming.bus import BusClosedError, BusUnavailableError, StoredEvent
from app.streaming.resume import stream_events
from tests.unit.streaming.doubles import MemoryStore, ScriptedBus, done, stored, wait_until

CONV = "conv_1"


async def collect(bus: ScriptedBus, store: MemoryStore, after: str) -> list[StoredEvent]:
    return [event async for event in stream_events(bus, store, CONV, after, outage_poll_s=0.05)]


def ids(events: list[StoredEvent]) -> list[str]:
    return [e.id for e in events]


async def test_a_live_run_is_followed_on_the_bus_until_done() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [stored(1), stored(2)])
    task = asyncio.create_task(collect(bus, store, "0-0"))
    await wait_until(lambda: bus._logs[CONV].followers == 1)
    await bus.append(CONV, [stored(3), done(4)])
    assert ids(await asyncio.wait_for(task, 5)) == ids([stored(1), stored(2), stored(3), done(4)])
    assert bus._logs[CONV].followers == 0  # the follow was closed, not left to the collector


async def test_it_stops_right_after_the_first_done() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    events = [stored(1), done(2), stored(3, run_id="run_2"), done(4, run_id="run_2")]
    await bus.append(CONV, events)
    assert ids(await collect(bus, store, "0-0")) == ids(events[:2])
    assert ids(await collect(bus, store, events[1].id)) == ids(events[2:])


async def test_events_the_bus_lost_are_served_from_the_database_then_the_bus_is_followed() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    everything = [stored(n) for n in range(1, 11)]
    await store.save(CONV, everything[:8])  # the database lags a little behind
    await bus.append(CONV, everything[6:])  # the bus lost 1..6 (Redis restarted empty)
    task = asyncio.create_task(collect(bus, store, "0-0"))
    await wait_until(lambda: bus._logs[CONV].followers == 1)
    await bus.append(CONV, [done(11)])
    assert ids(await asyncio.wait_for(task, 5)) == ids([*everything, done(11)])


async def test_a_finished_run_whose_stream_expired_comes_from_the_database() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    events = [stored(n) for n in range(1, 1200)] + [done(1200)]
    await store.save(CONV, events)
    got = await collect(bus, store, stored(3).id)
    assert ids(got) == ids(events[3:])


async def test_no_duplicate_at_the_database_to_bus_seam() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await store.save(CONV, [stored(n) for n in range(1, 8)])
    await bus.append(CONV, [stored(n) for n in range(4, 10)] + [done(10)])
    await bus.delete(CONV)  # and back: the bus now starts at 5
    await bus.append(CONV, [stored(n) for n in range(5, 10)] + [done(10)])
    got = await collect(bus, store, stored(1).id)
    assert ids(got) == ids([*[stored(n) for n in range(2, 10)], done(10)])


async def test_events_missing_at_the_start_of_a_live_follow_are_fetched_from_the_database() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    task = asyncio.create_task(collect(bus, store, "0-0"))
    await wait_until(lambda: CONV in bus._logs and bus._logs[CONV].followers == 1)
    # Events 1-2 reached only the database; the bus resumes at 3.
    await store.save(CONV, [stored(1), stored(2)])
    await bus.append(CONV, [stored(3), done(4)])
    assert ids(await asyncio.wait_for(task, 5)) == ids([stored(1), stored(2), stored(3), done(4)])


async def test_while_the_bus_is_down_the_database_serves_until_done() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [stored(1)])
    bus.follow_error = lambda: BusUnavailableError("redis down")
    task = asyncio.create_task(collect(bus, store, "0-0"))
    await store.save(CONV, [stored(1), stored(2)])
    await wait_until(lambda: store.reads >= 3)
    await store.save(CONV, [stored(3), done(4)])
    assert ids(await asyncio.wait_for(task, 5)) == ids([stored(1), stored(2), stored(3), done(4)])


async def test_the_stream_ends_quietly_when_the_bus_closes() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [stored(1)])
    bus.follow_error = lambda: BusClosedError("closing")
    assert await collect(bus, store, "0-0") == []


# ---- entries that name the event before them (StoredEvent.prev) -------------------------------


def linked(n: int) -> StoredEvent:
    """``stored(n)`` as the publisher puts it on the bus: naming ``stored(n - 1)`` before it."""
    return replace(stored(n), prev=stored(n - 1).id)


def linked_done(n: int) -> StoredEvent:
    return replace(done(n), prev=stored(n - 1).id)


async def follow_from(
    bus: ScriptedBus, store: MemoryStore, after: str, seam_wait_s: float
) -> list[StoredEvent]:
    stream = stream_events(bus, store, CONV, after, outage_poll_s=0.05, seam_wait_s=seam_wait_s)
    return [event async for event in stream]


async def test_a_new_stream_needs_the_database_once_however_far_behind_it_is() -> None:
    bus, store = ScriptedBus(), MemoryStore()  # the database stores nothing: it is far behind
    task = asyncio.create_task(follow_from(bus, store, stored(0).id, seam_wait_s=5))
    await wait_until(lambda: CONV in bus._logs and bus._logs[CONV].followers == 1)
    await bus.append(CONV, [linked(1), linked(2)])
    await bus.append(CONV, [linked(3), linked_done(4)])
    assert ids(await asyncio.wait_for(task, 2)) == ids([stored(1), stored(2), stored(3), done(4)])
    assert store.reads == 1  # before following: does the database hold what the bus does not?


async def test_a_reconnect_into_a_run_needs_no_database_read() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [linked(n) for n in range(1, 5)] + [linked_done(5)])
    assert ids(await follow_from(bus, store, stored(2).id, seam_wait_s=5)) == ids(
        [stored(3), stored(4), done(5)]
    )
    assert store.reads == 0


async def test_a_stream_deleted_under_a_live_follower_is_filled_from_the_database() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [linked(1), linked(2)])
    task = asyncio.create_task(follow_from(bus, store, stored(0).id, seam_wait_s=5))
    await wait_until(lambda: bus._logs[CONV].followers == 1 and store.reads == 0)
    await bus.delete(CONV)  # Redis lost the key (eviction, DEL) without dropping a connection
    await store.save(CONV, [stored(1), stored(2), stored(3), stored(4)])
    await bus.append(CONV, [linked(5), linked_done(6)])  # 3 and 4 never reached the bus
    got = await asyncio.wait_for(task, 2)
    assert ids(got) == ids([*[stored(n) for n in range(1, 6)], done(6)])


async def test_at_a_hole_the_stream_waits_for_the_database_to_store_what_is_missing() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [linked(5)])  # Redis restarted empty after 1..4 were sent
    task = asyncio.create_task(follow_from(bus, store, stored(2).id, seam_wait_s=5))
    await wait_until(lambda: store.reads >= 3)  # polling: the database is behind
    assert not task.done()
    await store.save(CONV, [stored(n) for n in range(1, 6)])
    await bus.append(CONV, [linked_done(6)])
    assert ids(await asyncio.wait_for(task, 2)) == ids([stored(3), stored(4), stored(5), done(6)])


async def test_a_hole_nobody_can_fill_is_logged_and_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus, store = ScriptedBus(), MemoryStore()
    await bus.append(CONV, [linked(5), linked_done(6)])
    with caplog.at_level(logging.WARNING, logger="app.streaming.resume"):
        got = await follow_from(bus, store, stored(2).id, seam_wait_s=0.05)
    assert ids(got) == ids([stored(5), done(6)])
    lost = [r for r in caplog.records if "events lost" in r.getMessage()]
    assert len(lost) == 1 and lost[0].before == stored(5).id  # type: ignore[attr-defined]
