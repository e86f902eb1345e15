"""The Redis cancel signal, across independent Redis clients (as across workers)."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from app.streaming.redis_signals import RedisCancelSignal
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
