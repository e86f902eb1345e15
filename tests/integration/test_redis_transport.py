"""The transport end to end on real Redis and a real database (SQLite and PostgreSQL).

RunPublisher -> RedisEventBus + EventRepo -> stream_events: batching, exact delta concatenation,
and resume from the database when Redis lost the stream.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from app.db.repositories import ConversationRepo, EventRepo
from app.db.session import Database
from app.engine.events import AnswerDelta, AnswerStarted, RunDone, ThinkingStarted
from app.streaming.bus import StoredEvent, parse_cursor
from app.streaming.publisher import RunPublisher
from app.streaming.redis_bus import RedisEventBus
from app.streaming.resume import stream_events
from tests.unit.streaming.doubles import MemoryStore, wait_until

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("AGENTSTREAM_TEST_REDIS", "redis://127.0.0.1:6379/0")
RUN = "run_1"


@pytest.fixture
async def redis_bus() -> AsyncIterator[RedisEventBus]:
    """A Redis bus under a key prefix private to the test; its keys are deleted afterwards."""
    client: Redis = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    prefix = f"agentstream-test:{secrets.token_hex(6)}"
    bus = RedisEventBus(REDIS_URL, prefix, block_ms=200)
    try:
        yield bus
    finally:
        await bus.close()
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def run_done(answer: str) -> RunDone:
    return RunDone(answer=answer, iterations=1, usage={"total_tokens": 1}, elapsed=0.1, status="completed")


def answer_text(events: list[StoredEvent]) -> str:
    return "".join(
        data["content"]
        for data in (orjson.loads(e.data) for e in events if e.event == "answer")
        if data["status"] == "delta"
    )


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


async def collect(bus: RedisEventBus, store: Any, conv: str, after: str) -> list[StoredEvent]:
    return [event async for event in stream_events(bus, store, conv, after)]


async def test_many_tokens_cost_few_redis_round_trips_and_arrive_exactly(redis_bus: RedisEventBus) -> None:
    store = MemoryStore()
    conv = "conv_tokens"
    reader = asyncio.create_task(collect(redis_bus, store, conv, "0-0"))
    await wait_until(lambda: conv in redis_bus.subscriptions)
    round_trips = count_round_trips(redis_bus)
    publisher = RunPublisher(redis_bus, store, conv, RUN, last_id=None)
    tokens = [f"tok{i} " if i % 50 else "line\r\n" for i in range(2000)]
    await publisher.publish(AnswerStarted())
    for token in tokens:
        await publisher.publish(AnswerDelta(token))
        await asyncio.sleep(0)  # the engine yields between tokens, as a real stream does
    await publisher.publish(run_done("".join(tokens)))
    await publisher.close()

    received = await asyncio.wait_for(reader, 10)
    assert answer_text(received) == "".join(tokens)
    assert received[-1].event == "done"
    assert 0 < len(round_trips) <= len(tokens) // 10, (
        f"{len(round_trips)} round trips for {len(tokens)} tokens"
    )
    assert store.all(conv) == received  # what the database keeps is what the client saw


async def test_a_quiet_runs_events_go_to_redis_from_publish_itself_in_order_and_as_stored(
    redis_bus: RedisEventBus,
) -> None:
    # Tokens that come one at a time (the run idle in between) are sent by publish() itself,
    # without the run's send loop (bench/NOTES.md, sixth session); a burst that comes while one is
    # in flight still goes through the loop, after it. The client, the stream and the store agree.
    store = MemoryStore()
    conv = "conv_direct"
    reader = asyncio.create_task(collect(redis_bus, store, conv, "0-0"))
    await wait_until(lambda: conv in redis_bus.subscriptions)
    # coalesce_ms=0: a token is never held for the next, however soon it comes.
    publisher = RunPublisher(redis_bus, store, conv, RUN, last_id=None, coalesce_ms=0)
    looped: list[int] = []
    send = publisher._send

    async def counted(batch: list[StoredEvent], failed: Exception | None = None) -> None:
        looped.append(len(batch))
        await send(batch, failed)

    publisher._send = counted  # type: ignore[method-assign]
    await publisher.publish(ThinkingStarted(iteration=1))
    tokens: list[str] = []
    for i in range(30):
        tokens.append(f"slow{i} ")
        await publisher.publish(AnswerDelta(tokens[-1]))
        # The run idle before the next token: it is on the bus, nothing queued or in flight.
        await wait_until(lambda: not publisher._pending and not publisher._sending)
    for i in range(30):
        tokens.append(f"fast{i} ")
        await publisher.publish(AnswerDelta(tokens[-1]))  # behind the one in flight: merged, looped
    await publisher.publish(run_done("".join(tokens)))
    await publisher.close()

    received = await asyncio.wait_for(reader, 10)
    assert answer_text(received) == "".join(tokens)
    held = await redis_bus.read_after(conv, "0-0")
    assert held == received == store.all(conv)
    assert [e.prev for e in received[1:]] == [e.id for e in received[:-1]]  # each names the last
    assert len(looped) <= 3, looped  # the burst behind the last slow token, and the done


async def test_resume_serves_from_the_database_what_redis_lost_mid_run(
    redis_bus: RedisEventBus, database: Database
) -> None:
    repo = EventRepo(database.sessionmaker)
    conv = (await ConversationRepo(database.sessionmaker).create("owner", "t", {})).id
    publisher = RunPublisher(redis_bus, repo, conv, RUN, last_id=None, store_interval_ms=5)
    for i in range(30):
        await publisher.publish(ThinkingStarted(iteration=i))
    await publisher.publish(AnswerStarted())
    await publisher.publish(AnswerDelta("first half, "))
    await publisher.flush()
    await redis_bus.delete(conv)  # Redis restarted empty: the stream is gone

    reader = asyncio.create_task(collect(redis_bus, repo, conv, "0-0"))
    await publisher.publish(AnswerDelta("second "))
    await publisher.publish(AnswerDelta("half"))
    await publisher.publish(run_done("first half, second half"))
    await publisher.close()

    received = await asyncio.wait_for(reader, 10)
    stored = await repo.read_after(conv, "0-0")
    assert [e.id for e in received] == [e.id for e in stored]  # everything, once, in order
    assert received == stored
    assert answer_text(received) == "first half, second half"
    keys = [parse_cursor(e.id) for e in received]
    assert keys == sorted(set(keys))


async def test_a_late_client_after_the_stream_expired_gets_the_run_from_the_database(
    redis_bus: RedisEventBus, database: Database
) -> None:
    repo = EventRepo(database.sessionmaker)
    conv = (await ConversationRepo(database.sessionmaker).create("owner", "t", {})).id
    publisher = RunPublisher(redis_bus, repo, conv, RUN, last_id=None)
    for i in range(5):
        await publisher.publish(ThinkingStarted(iteration=i))
    await publisher.publish(run_done("x"))
    await publisher.close()
    await redis_bus.delete(conv)

    stored = await repo.read_after(conv, "0-0")
    received = await collect(redis_bus, repo, conv, stored[1].id)
    assert received == stored[2:]
    assert received[-1].event == "done"


async def test_a_second_run_continues_the_ids_and_clears_the_first_runs_expiry(
    redis_bus: RedisEventBus,
) -> None:
    store = MemoryStore()
    conv = "conv_two_runs"
    first = RunPublisher(redis_bus, store, conv, "run_1", last_id=None, retention_s=300)
    await first.publish(ThinkingStarted(iteration=1))
    done_event = await first.publish(run_done("a"))
    await first.close()
    raw = Redis.from_url(REDIS_URL)
    try:
        key = redis_bus.stream_key(conv)
        assert 0 < await raw.ttl(key) <= 300
        assert done_event is not None
        second = RunPublisher(redis_bus, store, conv, "run_2", last_id=done_event.id, clock_ms=lambda: 0)
        await second.publish(ThinkingStarted(iteration=1))
        await second.flush()
        assert await raw.ttl(key) == -1
        await second.publish(run_done("b"))
        await second.close()
    finally:
        await raw.aclose()
    events = await redis_bus.read_after(conv, "0-0")
    assert [e.run_id for e in events] == ["run_1", "run_1", "run_2", "run_2"]
    keys = [parse_cursor(e.id) for e in events]
    assert keys == sorted(set(keys))
