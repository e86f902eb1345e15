"""A worker's own appends handed straight to its own followers (``Subscription.feed`` after
``APPEND_SCRIPT``, app.streaming.redis_bus), on the real Redis: in order, each once, never past an
entry another process appended, and the stream back with the reader when the feed cannot vouch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from app.streaming.bus import StoredEvent
from app.streaming.redis_bus import RedisEventBus
from tests.integration.test_redis_bus import REDIS_URL, _following, redis_prefix  # noqa: F401
from tests.unit.streaming.doubles import wait_until

pytestmark = pytest.mark.redis
CONV = "conv_feed"


def chain(start: int, count: int, prev: str | None, *, last: str = "step") -> list[StoredEvent]:
    """``count`` events with ids ``<start>-0``... each naming the one before as ``prev``, as a
    run's publisher writes them."""
    events = []
    for n in range(start, start + count):
        event = last if n == start + count - 1 else "step"
        events.append(StoredEvent(f"{n}-0", event, f'{{"n":{n},"run_id":"run_1"}}', "run_1", prev))
        prev = events[-1].id
    return events


class Watched:
    """A bus whose reader's reads are recorded (the ids each ``XREAD`` brought back), and one
    follower of ``CONV`` on it."""

    def __init__(self, bus: RedisEventBus) -> None:
        self.bus = bus
        self.seen: list[StoredEvent] = []
        self.read_back: list[str] = []
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def follow() -> None:
            async for event in self.bus.follow(CONV, "0-0"):
                self.seen.append(event)

        self.task = asyncio.create_task(follow())
        await wait_until(lambda: _following(self.bus, CONV))
        reader = self.bus._reader
        assert reader is not None
        execute = reader.connection.execute

        async def recorded(commands: Any, timeout_s: float | None = None) -> Any:
            replies = await execute(commands, timeout_s)
            for _key, entries in replies[0] or ():
                self.read_back += [entry_id for entry_id, _ in entries]
            return replies

        reader.connection.execute = recorded  # type: ignore[method-assign]

    async def has(self, count: int) -> None:
        await wait_until(lambda: len(self.seen) >= count)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def watched(redis_prefix: str) -> AsyncIterator[Watched]:  # noqa: F811
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200)
    watched = Watched(bus)
    await watched.start()
    try:
        yield watched
    finally:
        await watched.stop()
        await bus.close()


@pytest.fixture
async def other_worker(redis_prefix: str) -> AsyncIterator[RedisEventBus]:  # noqa: F811
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200)
    try:
        yield bus
    finally:
        await bus.close()


def ids(events: list[StoredEvent]) -> list[str]:
    return [e.id for e in events]


async def test_own_appends_reach_the_followers_in_order_without_being_read_back(watched: Watched) -> None:
    first = chain(1001, 2, None)
    await watched.bus.append(CONV, first)  # the stream was empty, no prev: the reader brings these
    await watched.has(2)

    rest = chain(1003, 40, first[-1].id)
    for n in range(0, 40, 4):
        await watched.bus.append(CONV, rest[n : n + 4])
    await watched.has(42)

    assert ids(watched.seen) == ids(first + rest)
    assert watched.seen == first + rest
    # Handed over, not read back (but for the first one: the reader may be blocked on the stream
    # when it comes, and is woken by it).
    assert not set(watched.read_back) & set(ids(rest[4:]))
    sub = watched.bus.subscriptions[CONV]
    assert sub.fed_until > asyncio.get_running_loop().time()
    assert await watched.bus.read_after(CONV, "0-0") == first + rest  # and in the stream, as sent


async def test_an_append_of_another_worker_in_between_is_delivered_in_its_place(
    watched: Watched, other_worker: RedisEventBus
) -> None:
    mine = chain(1001, 3, None)
    await watched.bus.append(CONV, mine[:2])
    await watched.has(2)
    await watched.bus.append(CONV, mine[2:])  # fed
    await watched.has(3)

    theirs = chain(1004, 1, mine[-1].id)
    await other_worker.append(CONV, theirs)
    # This worker's next append names its own last as prev: the stream shows another in between.
    later = chain(1005, 2, mine[-1].id)
    await watched.bus.append(CONV, later)
    await watched.has(6)

    assert ids(watched.seen) == ids(mine + theirs + later)
    assert set(ids(theirs + later)) <= set(watched.read_back)


async def test_an_append_of_another_worker_after_the_last_feed_arrives_when_the_feed_lapses(
    watched: Watched, other_worker: RedisEventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.streaming.redis_streams.LOCAL_FEED_S", 0.3)
    mine = chain(1001, 3, None)
    await watched.bus.append(CONV, mine[:2])
    await watched.has(2)
    await watched.bus.append(CONV, mine[2:])
    await watched.has(3)
    assert watched.bus.subscriptions[CONV].fed_until > 0

    theirs = chain(1004, 2, mine[-1].id)
    await other_worker.append(CONV, theirs)
    await watched.has(5)

    assert ids(watched.seen) == ids(mine + theirs)


@pytest.mark.parametrize("last", ["done", "phase"])
async def test_a_done_or_a_phase_gives_the_stream_back_to_the_reader(watched: Watched, last: str) -> None:
    first = chain(1001, 2, None)
    await watched.bus.append(CONV, first)
    await watched.has(2)
    await watched.bus.append(CONV, chain(1003, 2, first[-1].id))
    await watched.has(4)
    assert watched.bus.subscriptions[CONV].fed_until > 0
    await watched.bus.append(CONV, chain(1005, 2, "1004-0", last=last))
    await watched.has(6)

    assert watched.seen[-1].event == last
    assert watched.bus.subscriptions[CONV].fed_until == 0.0


async def test_appends_go_on_after_redis_forgets_the_script(watched: Watched) -> None:
    first = chain(1001, 2, None)
    await watched.bus.append(CONV, first)
    await watched.has(2)
    client: Redis = Redis.from_url(REDIS_URL)
    try:
        await client.script_flush()
    finally:
        await client.aclose()

    rest = chain(1003, 3, first[-1].id)
    await watched.bus.append(CONV, rest)
    await watched.has(5)

    assert watched.seen == first + rest
    assert await watched.bus.read_after(CONV, "0-0") == first + rest
