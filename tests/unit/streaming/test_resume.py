"""stream_events: every event after the cursor once, in order, from the bus or the database."""

from __future__ import annotations

import asyncio

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
