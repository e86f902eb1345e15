"""The Redis InterruptQueue and cancel signal, across independent Redis clients (as across workers)."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from app.engine.interrupts import InterruptQueue, InterruptQueueFullError
from app.streaming.redis_signals import RedisCancelSignal, RedisInterruptQueue
from tests.unit.streaming.doubles import wait_until

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("AGENTSTREAM_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture
async def clients() -> AsyncIterator[tuple[Redis, Redis, str]]:
    """Two independent clients (two workers) and a key prefix private to the test."""
    first: Redis = Redis.from_url(REDIS_URL)
    second: Redis = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        await first.ping()
    except Exception as exc:
        await first.aclose()
        await second.aclose()
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    prefix = f"agentstream-test:{secrets.token_hex(6)}"
    try:
        yield first, second, prefix
    finally:
        keys = [key async for key in first.scan_iter(match=f"{prefix}:*")]
        if keys:
            await first.delete(*keys)
        await first.aclose()
        await second.aclose()


async def test_interrupts_put_through_one_client_are_drained_through_another(
    clients: tuple[Redis, Redis, str],
) -> None:
    first, second, prefix = clients
    producer = RedisInterruptQueue(first, prefix, "conv_1")
    consumer: InterruptQueue = RedisInterruptQueue(second, prefix, "conv_1")
    assert isinstance(consumer, InterruptQueue)
    assert await producer.put("first") == 1
    assert await producer.put("second, with ünïcode\nand a newline") == 2
    assert await consumer.drain() == ["first", "second, with ünïcode\nand a newline"]
    assert await consumer.drain() == []
    assert await RedisInterruptQueue(first, prefix, "conv_2").drain() == []


async def test_concurrent_puts_and_drains_lose_and_repeat_nothing(clients: tuple[Redis, Redis, str]) -> None:
    first, second, prefix = clients
    producer = RedisInterruptQueue(first, prefix, "conv_1")
    consumer = RedisInterruptQueue(second, prefix, "conv_1")
    drained: list[str] = []
    stop = asyncio.Event()

    async def drain_loop() -> None:
        while not stop.is_set():
            drained.extend(await consumer.drain())
            await asyncio.sleep(0)

    task = asyncio.create_task(drain_loop())
    sent = [f"m{i}" for i in range(200)]
    for message in sent:
        await producer.put(message)
    stop.set()
    await task
    drained.extend(await consumer.drain())
    assert drained == sent


async def test_a_full_queue_refuses_a_put_from_any_client_and_takes_puts_again_once_drained(
    clients: tuple[Redis, Redis, str],
) -> None:
    first, second, prefix = clients
    one = RedisInterruptQueue(first, prefix, "conv_1", limit=3)
    other = RedisInterruptQueue(second, prefix, "conv_1", limit=3)
    assert [await one.put("a"), await other.put("b"), await one.put("c")] == [1, 2, 3]

    for queue in (one, other):
        with pytest.raises(InterruptQueueFullError):
            await queue.put("one too many")

    assert await other.drain() == ["a", "b", "c"]
    assert await one.put("d") == 1


async def test_concurrent_puts_never_fill_the_queue_past_its_limit(clients: tuple[Redis, Redis, str]) -> None:
    first, second, prefix = clients
    queues = [RedisInterruptQueue(client, prefix, "conv_1", limit=10) for client in (first, second)]

    async def put(n: int) -> bool:
        try:
            await queues[n % 2].put(f"m{n}")
        except InterruptQueueFullError:
            return False
        return True

    accepted = await asyncio.gather(*(put(n) for n in range(40)))

    assert sum(accepted) == 10
    assert len(await queues[0].drain()) == 10


async def test_the_interrupt_list_expires_if_nobody_drains_it(clients: tuple[Redis, Redis, str]) -> None:
    first, _, prefix = clients
    await RedisInterruptQueue(first, prefix, "conv_1", ttl_s=100).put("x")
    assert 0 < await first.ttl(f"{prefix}:interrupts:conv_1") <= 100


async def test_cancel_requested_through_one_client_reaches_the_listener_of_another(
    clients: tuple[Redis, Redis, str],
) -> None:
    first, second, prefix = clients
    listener = RedisCancelSignal(first, prefix)
    requester = RedisCancelSignal(second, prefix)
    seen: list[str] = []
    await listener.listen(seen.append)
    try:
        assert not await listener.is_requested("run_1")
        await requester.request("run_1")
        await wait_until(lambda: seen == ["run_1"])
        assert await listener.is_requested("run_1")
        assert not await listener.is_requested("run_2")
    finally:
        await listener.close()


async def _wait_subscribed(client: Redis, channel: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while (await client.pubsub_numsub(channel))[0][1] < 1:
        assert loop.time() < deadline, "listener never subscribed again"
        await asyncio.sleep(0.01)


async def test_cancel_listener_reconnects_and_catches_up_on_requests_it_missed(
    clients: tuple[Redis, Redis, str],
) -> None:
    _, second, prefix = clients
    name = f"cancel-{secrets.token_hex(4)}"
    listening: Redis = Redis.from_url(REDIS_URL, client_name=name)
    listener = RedisCancelSignal(listening, prefix)
    requester = RedisCancelSignal(second, prefix)
    seen: list[str] = []
    await listener.listen(seen.append, active_runs=lambda: ["run_missed", "run_other"])
    try:
        # Kill the pubsub connection, and cancel while the listener is away.
        killed = 0
        for client in await second.client_list():
            if client.get("name") == name:
                await second.execute_command("CLIENT", "KILL", "ID", client["id"])
                killed += 1
        assert killed >= 1
        await requester.request("run_missed")
        await wait_until(lambda: "run_missed" in seen)
        await _wait_subscribed(second, f"{prefix}:cancel")
        await requester.request("run_live")
        await wait_until(lambda: "run_live" in seen)
        assert "run_other" not in seen
    finally:
        await listener.close()
        await listening.aclose()
