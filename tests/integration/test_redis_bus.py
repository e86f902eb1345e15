"""The EventBus contract, run on the in-process bus, on Redis Streams and on the Redis Streams of a
Redis Cluster, plus Redis-only behaviour (the cluster's own: ``tests/integration/cluster/``).

Redis tests use the real server at ``AGENTSTREAM_TEST_REDIS`` (default ``redis://127.0.0.1:6379/0``),
or the cluster at ``AGENTSTREAM_TEST_REDIS_CLUSTER``, under a key prefix private to the test,
deleted afterwards.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio import Redis

from app.streaming.bus import (
    BusClosedError,
    BusUnavailableError,
    EventBus,
    EventOrderError,
    StoredEvent,
)
from app.streaming.memory import MemoryEventBus
from app.streaming.redis_bus import RedisEventBus
from app.streaming.redis_cluster_bus import RedisClusterEventBus
from app.streaming.redis_streams import RedisStreamsBus
from tests.support.redis_cluster import cluster_prefix
from tests.unit.streaming.doubles import stored, wait_until

REDIS_URL = os.environ.get("AGENTSTREAM_TEST_REDIS", "redis://127.0.0.1:6379/0")
CONV = "conv_1"


async def _redis_or_skip() -> Redis:
    client: Redis = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    return client


async def _delete_prefix(client: Redis, prefix: str) -> None:
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix private to the test; every key under it is deleted afterwards."""
    client = await _redis_or_skip()
    prefix = f"agentstream-test:{secrets.token_hex(6)}"
    try:
        yield prefix
    finally:
        await _delete_prefix(client, prefix)
        await client.aclose()


@pytest.fixture
async def redis_bus(redis_prefix: str) -> AsyncIterator[RedisEventBus]:
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200)
    try:
        yield bus
    finally:
        await bus.close()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=pytest.mark.redis),
    ]
)
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[EventBus]:
    """The bus under contract: the in-process one, then Redis Streams under a private prefix, on
    one Redis and on a Redis Cluster."""
    if request.param == "memory":
        memory = MemoryEventBus()
        yield memory
        await memory.close()
        return
    if request.param == "redis-cluster":
        async with cluster_prefix() as (url, prefix):
            cluster_bus = RedisClusterEventBus(url, prefix)
            try:
                yield cluster_bus
            finally:
                await cluster_bus.close()
        return
    client = await _redis_or_skip()
    prefix = f"agentstream-test:{secrets.token_hex(6)}"
    redis_bus = RedisEventBus(REDIS_URL, prefix, block_ms=200)
    try:
        yield redis_bus
    finally:
        await redis_bus.close()
        await _delete_prefix(client, prefix)
        await client.aclose()


async def collect(bus: EventBus, after: str, count: int, conv: str = CONV) -> list[StoredEvent]:
    out: list[StoredEvent] = []
    follow = bus.follow(conv, after)
    try:
        async for event in follow:
            out.append(event)
            if len(out) == count:
                break
    finally:
        await follow.aclose()  # type: ignore[attr-defined]
    return out


def _following(bus: EventBus, conv: str) -> bool:
    """Whether a follower of ``conv`` is waiting for live events (not replaying)."""
    if isinstance(bus, RedisStreamsBus):
        sub = bus.subscriptions.get(conv)
        return sub is not None and bool(sub.followers)
    log = bus._logs.get(conv)  # type: ignore[attr-defined]
    return log is not None and log.followers > 0


# ---- the contract ----------------------------------------------------------------------------


async def test_read_after_is_exclusive_ordered_and_limited(bus: EventBus) -> None:
    events = [stored(n) for n in range(1, 11)]
    await bus.append(CONV, events[:4])
    await bus.append(CONV, events[4:])
    assert await bus.read_after(CONV, "0-0") == events
    assert await bus.read_after(CONV, events[2].id) == events[3:]
    assert await bus.read_after(CONV, events[2].id, limit=2) == events[3:5]
    assert await bus.read_after(CONV, events[-1].id) == []
    assert await bus.read_after("conv_other", "0-0") == []


async def test_oldest_and_last_id_name_the_ends_of_what_the_bus_holds(bus: EventBus) -> None:
    assert await bus.oldest_id(CONV) is None
    assert await bus.last_id(CONV) is None
    await bus.append(CONV, [stored(1), stored(2), stored(3)])
    assert await bus.oldest_id(CONV) == stored(1).id
    assert await bus.last_id(CONV) == stored(3).id


async def test_an_id_not_above_the_newest_is_rejected(bus: EventBus) -> None:
    await bus.append(CONV, [stored(1), stored(5)])
    with pytest.raises(EventOrderError):
        await bus.append(CONV, [stored(5)])
    with pytest.raises(EventOrderError):
        await bus.append(CONV, [stored(3)])
    assert [e.id for e in await bus.read_after(CONV, "0-0")] == [stored(1).id, stored(5).id]


async def test_follow_replays_then_goes_live_without_gap_or_duplicate(bus: EventBus) -> None:
    events = [stored(n) for n in range(1, 301)]
    await bus.append(CONV, events[:100])
    reader = asyncio.create_task(collect(bus, "0-0", 300))
    # Appends land while the follower is replaying, registering and going live.
    for start in range(100, 300, 5):
        await bus.append(CONV, events[start : start + 5])
        await asyncio.sleep(0)
    assert await asyncio.wait_for(reader, 10) == events


async def test_every_reader_gets_the_id_before_each_event(bus: EventBus) -> None:
    chain = [replace(stored(n), prev=stored(n - 1).id) for n in (1, 2, 3)]
    await bus.append(CONV, chain[:2])
    task = asyncio.create_task(collect(bus, chain[1].id, 1))
    await wait_until(lambda: _following(bus, CONV))
    await bus.append(CONV, chain[2:])  # live, through the shared reader on Redis
    followed = chain[:2] + await asyncio.wait_for(task, 5)
    task = asyncio.create_task(collect(bus, "0-0", 3))
    followed = await asyncio.wait_for(task, 5)
    for got in (await bus.read_after(CONV, "0-0"), followed):
        assert [(e.id, e.prev) for e in got] == [(e.id, e.prev) for e in chain]


async def test_follow_from_a_cursor_starts_right_after_it(bus: EventBus) -> None:
    events = [stored(n) for n in range(1, 21)]
    await bus.append(CONV, events[:10])
    reader = asyncio.create_task(collect(bus, events[6].id, 13))
    await bus.append(CONV, events[10:])
    assert await asyncio.wait_for(reader, 10) == events[7:]


async def test_follow_of_an_empty_conversation_waits_for_the_first_event(bus: EventBus) -> None:
    reader = asyncio.create_task(collect(bus, "0-0", 2))
    await asyncio.sleep(0.05)
    assert not reader.done()
    await bus.append(CONV, [stored(1), stored(2)])
    assert await asyncio.wait_for(reader, 10) == [stored(1), stored(2)]


async def test_every_follower_gets_every_event(bus: EventBus) -> None:
    events = [stored(n) for n in range(1, 51)]
    readers = [asyncio.create_task(collect(bus, "0-0", 50)) for _ in range(5)]
    for event in events:
        await bus.append(CONV, [event])
        await asyncio.sleep(0)
    results = await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert all(result == events for result in results)


async def test_conversations_do_not_see_each_others_events(bus: EventBus) -> None:
    reader = asyncio.create_task(collect(bus, "0-0", 2, conv="conv_a"))
    await bus.append("conv_b", [stored(1)])
    await bus.append("conv_a", [stored(2), stored(3)])
    assert await asyncio.wait_for(reader, 10) == [stored(2), stored(3)]


async def test_expire_forgets_the_events_after_the_delay(bus: EventBus) -> None:
    await bus.append(CONV, [stored(1)])
    await bus.expire(CONV, 1)
    assert await bus.oldest_id(CONV) == stored(1).id  # not before the delay

    async def gone() -> bool:
        return await bus.oldest_id(CONV) is None

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not await gone():
        assert loop.time() < deadline, "events never expired"
        await asyncio.sleep(0.05)
    assert await bus.read_after(CONV, "0-0") == []


async def test_delete_forgets_the_events_and_followers_see_later_appends(bus: EventBus) -> None:
    await bus.append(CONV, [stored(1), stored(2)])
    reader = asyncio.create_task(collect(bus, stored(2).id, 1))
    await asyncio.sleep(0.01)
    await bus.delete(CONV)
    assert await bus.oldest_id(CONV) is None and await bus.read_after(CONV, "0-0") == []
    await bus.append(CONV, [stored(3)])
    assert await asyncio.wait_for(reader, 10) == [stored(3)]


async def test_ping_and_close(bus: EventBus) -> None:
    assert await bus.ping() is True
    await bus.close()
    with pytest.raises(BusClosedError):
        await bus.append(CONV, [stored(1)])


async def test_close_ends_followers_with_bus_closed(bus: EventBus) -> None:
    await bus.append(CONV, [stored(1)])
    reader = asyncio.create_task(collect(bus, "0-0", 2))
    await asyncio.sleep(0.05)
    await bus.close()
    with pytest.raises(BusClosedError):
        await asyncio.wait_for(reader, 10)


# ---- Redis only --------------------------------------------------------------------------------


def count_round_trips(bus: RedisEventBus) -> list[int]:
    """Spy: the size of every round trip the bus's stream writer makes."""
    round_trips: list[int] = []
    connection = bus._writer_connection
    execute = connection.execute

    async def counted(commands: Any, timeout_s: float | None = None) -> Any:
        round_trips.append(len(commands))
        return await execute(commands, timeout_s)

    connection.execute = counted  # type: ignore[method-assign]
    return round_trips


@pytest.mark.redis
async def test_redis_append_of_a_batch_is_one_round_trip(redis_bus: RedisEventBus) -> None:
    round_trips = count_round_trips(redis_bus)
    await redis_bus.append(CONV, [stored(n) for n in range(1, 201)])
    assert round_trips == [1]  # one script call: 200 XADD and one PERSIST in Redis
    assert len(await redis_bus.read_after(CONV, "0-0")) == 200


@pytest.mark.redis
async def test_redis_appends_of_many_conversations_share_round_trips(redis_bus: RedisEventBus) -> None:
    round_trips = count_round_trips(redis_bus)
    await asyncio.gather(*(redis_bus.append(f"conv_{i}", [stored(1), stored(2)]) for i in range(50)))
    assert sum(round_trips) == 50 and len(round_trips) <= 2  # a script call per conversation
    for i in range(50):
        assert await redis_bus.read_after(f"conv_{i}", "0-0") == [stored(1), stored(2)]


@pytest.mark.redis
async def test_redis_closed_while_reader_and_writer_wait_between_rounds_fails_every_caller(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pause after a small round made long enough that the close surely lands in it.
    monkeypatch.setattr("app.streaming.redis_bus.LINGER_S", 60.0)
    monkeypatch.setattr("app.streaming.redis_streams.LINGER_S", 60.0)
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200)
    seen: list[StoredEvent] = []

    async def follow() -> None:
        async for event in bus.follow(CONV, "0-0"):
            seen.append(event)

    follower = asyncio.create_task(follow())
    await wait_until(lambda: _following(bus, CONV))
    await bus.append(CONV, [stored(1)])  # the writer pauses after this round
    await wait_until(lambda: seen == [stored(1)])  # and the reader after the one that read it
    waiting_append = asyncio.create_task(bus.append(CONV, [stored(2)]))
    await wait_until(lambda: bool(bus._writer is not None and bus._writer._queue))  # behind the pause

    await bus.close()

    with pytest.raises(BusClosedError):
        await asyncio.wait_for(follower, 10)
    with pytest.raises(BusClosedError):
        await asyncio.wait_for(waiting_append, 10)


@pytest.mark.redis
async def test_redis_stream_entries_carry_event_data_and_run_id(
    redis_bus: RedisEventBus, redis_prefix: str
) -> None:
    event = StoredEvent("1700000000000-3", "answer", '{"status":"delta","content":"a\\nb","run_id":"r"}', "r")
    await redis_bus.append(CONV, [event])
    raw = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        entries = await raw.xrange(f"{redis_prefix}:events:{CONV}")
    finally:
        await raw.aclose()
    assert entries == [(event.id, {"event": "answer", "data": event.data, "run_id": "r"})]


@pytest.mark.redis
async def test_redis_entries_name_the_event_before_them_and_older_entries_still_read(
    redis_bus: RedisEventBus, redis_prefix: str
) -> None:
    key = f"{redis_prefix}:events:{CONV}"
    live = asyncio.create_task(collect(redis_bus, "0-0", 2))
    await wait_until(lambda: _following(redis_bus, CONV))
    raw = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        # An entry as an earlier version wrote it (no prev), then one as this version writes it.
        await raw.xadd(key, {"event": "step", "data": "{}", "run_id": "r"}, id="5-0")
        await redis_bus.append(CONV, [StoredEvent("6-0", "step", "{}", "r", prev="5-0")])
        entries = await raw.xrange(key)
    finally:
        await raw.aclose()
    assert entries[1] == ("6-0", {"event": "step", "data": "{}", "run_id": "r", "prev": "5-0"})
    expected = [("5-0", None), ("6-0", "5-0")]
    assert [(e.id, e.prev) for e in await asyncio.wait_for(live, 5)] == expected
    assert [(e.id, e.prev) for e in await redis_bus.read_after(CONV, "0-0")] == expected


@pytest.mark.redis
async def test_redis_rejects_ids_below_another_writers(redis_bus: RedisEventBus, redis_prefix: str) -> None:
    other = RedisEventBus(REDIS_URL, redis_prefix)
    try:
        await other.append(CONV, [stored(10)])
        with pytest.raises(EventOrderError, match="not greater"):
            await redis_bus.append(CONV, [stored(9), stored(11)])
    finally:
        await other.close()


@pytest.mark.redis
async def test_redis_a_new_append_cancels_a_pending_expiry(
    redis_bus: RedisEventBus, redis_prefix: str
) -> None:
    await redis_bus.append(CONV, [stored(1)])
    await redis_bus.expire(CONV, 600)
    raw = Redis.from_url(REDIS_URL)
    try:
        key = f"{redis_prefix}:events:{CONV}"
        assert 0 < await raw.ttl(key) <= 600
        await redis_bus.append(CONV, [stored(2)])  # the next run of the conversation
        assert await raw.ttl(key) == -1
    finally:
        await raw.aclose()


@pytest.mark.redis
async def test_redis_followers_of_many_conversations_share_one_blocking_connection(redis_prefix: str) -> None:
    name = f"bus-{secrets.token_hex(4)}"
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200, client_name=name, pool_size=4)
    try:
        convs = [f"conv_{i}" for i in range(10)]
        readers = [asyncio.create_task(collect(bus, "0-0", 2, conv=c)) for c in convs for _ in range(5)]
        await wait_until(lambda: sum(len(s.followers) for s in bus.subscriptions.values()) == 50)
        assert sorted(bus.subscriptions) == sorted(convs)
        for conv in convs:
            await bus.append(conv, [stored(1), stored(2)])
        results = await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert all(r == [stored(1), stored(2)] for r in results)
        # 50 followers: the blocking reader, the writer, and the small pool for replays.
        assert await _count_connections(name) <= 4 + 2
        await wait_until(lambda: not bus.subscriptions)  # unsubscribed as the followers left
    finally:
        await bus.close()


@pytest.mark.redis
async def test_redis_a_new_conversation_is_read_at_once_even_while_the_reader_blocks(
    redis_prefix: str,
) -> None:
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=30_000)
    try:
        first = asyncio.create_task(collect(bus, "0-0", 1, conv="conv_a"))
        await wait_until(lambda: "conv_a" in bus.subscriptions)
        await asyncio.sleep(0.05)  # the reader is now blocked in XREAD on conv_a alone
        second = asyncio.create_task(collect(bus, "0-0", 1, conv="conv_b"))
        await wait_until(lambda: "conv_b" in bus.subscriptions)
        await bus.append("conv_b", [stored(1)])
        # Far sooner than the 30 s block: CLIENT UNBLOCK made the reader include conv_b.
        assert await asyncio.wait_for(second, 5) == [stored(1)]
        await bus.append("conv_a", [stored(2)])
        assert await asyncio.wait_for(first, 5) == [stored(2)]
    finally:
        await bus.close()


async def _count_connections(name: str) -> int:
    admin = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        return sum(1 for c in await admin.client_list() if c.get("name") == name)
    finally:
        await admin.aclose()


@pytest.mark.redis
async def test_redis_slow_follower_neither_stalls_others_nor_loses_events(redis_prefix: str) -> None:
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200, follower_buffer=20)
    try:
        events = [stored(n) for n in range(1, 401)]
        release = asyncio.Event()
        slow_got: list[StoredEvent] = []

        async def slow() -> None:
            follow = bus.follow(CONV, "0-0")
            try:
                async for event in follow:
                    slow_got.append(event)
                    if len(slow_got) == 1:
                        await release.wait()  # stops reading while the others stream
                    if len(slow_got) == len(events):
                        return
            finally:
                await follow.aclose()  # type: ignore[attr-defined]

        slow_task = asyncio.create_task(slow())
        fast_task = asyncio.create_task(collect(bus, "0-0", len(events)))
        await wait_until(lambda: CONV in bus.subscriptions and len(bus.subscriptions[CONV].followers) == 2)
        for start in range(0, len(events), 10):
            await bus.append(CONV, events[start : start + 10])
            await asyncio.sleep(0)
        # The fast follower finishes while the slow one is still parked on its first event.
        assert await asyncio.wait_for(fast_task, 10) == events
        assert len(slow_got) == 1
        reader = bus.subscriptions.get(CONV)
        assert reader is None or len(reader.followers) == 0  # dropped: its buffer overflowed
        release.set()
        await asyncio.wait_for(slow_task, 10)
        assert slow_got == events
    finally:
        await bus.close()


async def _kill_connections(name: str) -> int:
    """Kill every Redis connection named ``name``, as a Redis restart would; returns how many."""
    admin = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        ids = [c["id"] for c in await admin.client_list() if c.get("name") == name]
        for client_id in ids:
            await admin.execute_command("CLIENT", "KILL", "ID", client_id)
        return len(ids)
    finally:
        await admin.aclose()


@pytest.mark.redis
async def test_redis_follow_survives_dropped_connections_without_gap_or_duplicate(redis_prefix: str) -> None:
    name = f"bus-{secrets.token_hex(4)}"
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200, client_name=name)
    try:
        events = [stored(n) for n in range(1, 41)]
        await bus.append(CONV, events[:10])
        reader = asyncio.create_task(collect(bus, "0-0", 40))
        await wait_until(lambda: CONV in bus.subscriptions)
        await bus.append(CONV, events[10:20])
        assert await _kill_connections(name) >= 2  # the blocking reader's and the shared pool's
        await bus.append(CONV, events[20:40])
        assert await asyncio.wait_for(reader, 10) == events
    finally:
        await bus.close()


@pytest.mark.redis
async def test_redis_follow_raises_when_redis_comes_back_without_the_stream(redis_prefix: str) -> None:
    name = f"bus-{secrets.token_hex(4)}"
    bus = RedisEventBus(REDIS_URL, redis_prefix, block_ms=200, client_name=name)
    try:
        await bus.append(CONV, [stored(1), stored(2)])
        reader = asyncio.create_task(collect(bus, "0-0", 5))
        await wait_until(lambda: CONV in bus.subscriptions)
        await bus.delete(CONV)  # as if Redis restarted empty...
        await _kill_connections(name)  # ...dropping the reader's connection
        await bus.append(CONV, [stored(4)])
        with pytest.raises(BusUnavailableError):
            await asyncio.wait_for(reader, 10)
    finally:
        await bus.close()


@pytest.mark.redis
async def test_redis_ping_is_false_when_redis_is_unreachable() -> None:
    bus = RedisEventBus("redis://127.0.0.1:1/0", "agentstream-test:nowhere", socket_timeout_s=0.5)
    try:
        assert await bus.ping() is False
        with pytest.raises(BusUnavailableError):
            await bus.append(CONV, [stored(1)])
    finally:
        await bus.close()
