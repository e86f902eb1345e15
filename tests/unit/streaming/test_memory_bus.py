"""MemoryEventBus specifics beyond the shared contract (tests/integration/test_redis_bus.py)."""

from __future__ import annotations

import asyncio

from app.streaming.memory import MemoryEventBus
from tests.unit.streaming.doubles import stored, wait_until

CONV = "conv_1"


async def test_a_conversation_idle_past_retention_is_dropped() -> None:
    bus = MemoryEventBus(retention_s=0.05)
    await bus.append(CONV, [stored(1)])
    assert await bus.oldest_id(CONV) == stored(1).id
    await wait_until(lambda: CONV not in bus._logs)
    assert await bus.read_after(CONV, "0-0") == []


async def test_appends_push_the_idle_deadline_back() -> None:
    bus = MemoryEventBus(retention_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for n in range(1, 6):
        await bus.append(CONV, [stored(n)])
        await asyncio.sleep(0.06)
    assert await bus.last_id(CONV) == stored(5).id  # 0.3 s after the first append: still held
    await wait_until(lambda: CONV not in bus._logs)
    assert loop.time() - started >= 0.2 + 0.24


async def test_an_append_after_expire_keeps_the_new_runs_events() -> None:
    bus = MemoryEventBus()
    await bus.append(CONV, [stored(1)])
    await bus.expire(CONV, 0)
    await bus.append(CONV, [stored(2)])  # the next run starts before the expiry fires
    await asyncio.sleep(0.02)
    assert [e.id for e in await bus.read_after(CONV, "0-0")] == [stored(1).id, stored(2).id]


async def test_expire_zero_drops_at_once_and_followers_keep_following() -> None:
    bus = MemoryEventBus()
    await bus.append(CONV, [stored(1)])
    got: list[str] = []

    async def follow() -> None:
        async for event in bus.follow(CONV, "0-0"):
            got.append(event.id)
            if len(got) == 2:
                return

    task = asyncio.create_task(follow())
    await wait_until(lambda: got == [stored(1).id])
    await bus.expire(CONV, 0)
    await wait_until(lambda: CONV not in bus._logs or bus._logs[CONV].events == [])
    await bus.append(CONV, [stored(2)])
    await asyncio.wait_for(task, 5)
    assert got == [stored(1).id, stored(2).id]


async def test_a_follower_that_stops_reading_holds_no_events_of_its_own() -> None:
    bus = MemoryEventBus()
    follow = bus.follow(CONV, "0-0")
    await bus.append(CONV, [stored(1)])
    assert (await anext(follow)).id == stored(1).id
    await bus.append(CONV, [stored(n) for n in range(2, 2002)])
    # The parked follower is only a position in the shared log.
    assert len(bus._logs[CONV].events) == 2001
    rest = [(await anext(follow)).id for _ in range(2000)]
    assert rest == [stored(n).id for n in range(2, 2002)]
    await follow.aclose()
    assert bus._logs[CONV].followers == 0


async def test_an_abandoned_empty_conversation_leaves_nothing_behind() -> None:
    bus = MemoryEventBus()
    follow = bus.follow("conv_empty", "0-0")
    task = asyncio.ensure_future(anext(follow))
    await wait_until(lambda: "conv_empty" in bus._logs)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await follow.aclose()
    assert "conv_empty" not in bus._logs


async def test_a_busy_conversation_keeps_about_maxlen_events_and_a_reader_behind_starts_after_them() -> None:
    """Runs that follow each other within the retention never let a conversation expire: its log is
    trimmed like a Redis stream's, and what is gone is in the database."""
    bus = MemoryEventBus(maxlen=100)
    follower = bus.follow(CONV, "0-0")
    for n in range(1, 301):
        await bus.append(CONV, [stored(n)])

    held = await bus.read_after(CONV, "0-0", limit=1000)
    assert 100 <= len(held) <= 100 + 100 // 8
    assert held[-1] == stored(300)
    first = await anext(follower)  # a reader at 0-0 now starts after the trimmed part (the gap)
    assert first == held[0] and first.id != stored(1).id
    await follower.aclose()
