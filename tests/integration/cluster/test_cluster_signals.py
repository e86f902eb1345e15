"""Run signals (cancel, released) and follow-up hints on a Redis Cluster (RUNS.md S-01), across
independent cluster clients (as across workers)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster

from app.streaming.redis_keys import RedisKeys
from app.streaming.redis_signals import RedisCancelSignal, RedisFollowUpHints
from tests.unit.streaming.doubles import wait_until

pytestmark = pytest.mark.redis


@pytest.fixture
async def workers(cluster: tuple[str, str]) -> AsyncIterator[tuple[RedisCluster, RedisCluster]]:
    """Two independent cluster clients, as two workers hold."""
    first = RedisCluster.from_url(cluster[0])
    second = RedisCluster.from_url(cluster[0])
    try:
        yield first, second
    finally:
        await first.aclose()
        await second.aclose()


@pytest.mark.parametrize("name", ["cancel", "released"])
async def test_a_signal_sent_through_one_worker_reaches_the_listener_of_another(
    workers: tuple[RedisCluster, RedisCluster], cluster: tuple[str, str], raw: RedisCluster, name: str
) -> None:
    first, second = workers
    prefix = cluster[1]
    listener = RedisCancelSignal(first, prefix, name=name, cluster=True)
    requester = RedisCancelSignal(second, prefix, name=name, cluster=True)
    seen: list[str] = []
    await listener.listen(seen.append)
    try:
        assert not await listener.is_requested("run_1", "conv_1")
        await requester.request("run_1", "conv_1")
        await requester.request("run_2")  # a caller that does not know the conversation
        await wait_until(lambda: seen == ["run_1", "run_2"])
        assert await listener.is_requested("run_1", "conv_1")
        assert await listener.is_requested("run_2")
        assert not await listener.is_requested("run_3", "conv_1")
        keys = RedisKeys(prefix, cluster=True)
        # The request is kept on the conversation's slot, beside its stream.
        assert await raw.exists(keys.signal(name, "run_1", "conv_1")) == 1
        assert raw.keyslot(keys.signal(name, "run_1", "conv_1")) == raw.keyslot(keys.events("conv_1"))
    finally:
        await listener.close()


async def test_the_cancel_listener_comes_back_after_losing_its_node_and_catches_up(
    workers: tuple[RedisCluster, RedisCluster], cluster: tuple[str, str], raw: RedisCluster
) -> None:
    _, second = workers
    prefix = cluster[1]
    name = f"cancel-{secrets.token_hex(4)}"
    listening = RedisCluster.from_url(cluster[0], client_name=name)
    listener = RedisCancelSignal(listening, prefix, cluster=True)
    requester = RedisCancelSignal(second, prefix, cluster=True)
    seen: list[str] = []
    await listener.listen(seen.append, active_runs=lambda: [("run_missed", "conv_1"), "run_other"])
    try:
        # Kill the listener's connections on every node; cancel while it is away.
        killed = 0
        for node in raw.get_nodes():
            for client in await raw.client_list(target_nodes=node):
                if client.get("name") == name:
                    await raw.execute_command("CLIENT", "KILL", "ID", client["id"], target_nodes=node)
                    killed += 1
        assert killed >= 1
        await requester.request("run_missed", "conv_1")
        await wait_until(lambda: "run_missed" in seen)

        async def live() -> bool:
            await requester.request("run_live", "conv_2")
            for _ in range(50):
                if "run_live" in seen:
                    return True
                await asyncio.sleep(0.01)
            return False

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await live():  # resubscribed by now, or on the next try
            assert loop.time() < deadline, "the listener never heard a request again"
        assert "run_other" not in seen
    finally:
        await listener.close()
        await listening.aclose()


async def test_follow_up_hints_are_shared_by_workers_on_the_conversations_slot(
    workers: tuple[RedisCluster, RedisCluster], cluster: tuple[str, str], raw: RedisCluster
) -> None:
    first, second = workers
    prefix = cluster[1]
    reader = RedisFollowUpHints(first, prefix, cluster=True)
    writer = RedisFollowUpHints(second, prefix, cluster=True)
    before = await reader.version("conv_1")
    await writer.bump("conv_1")
    after = await reader.version("conv_1")
    assert after != before
    assert await reader.version("conv_2") == before  # nothing for the others
    keys = RedisKeys(prefix, cluster=True)
    assert raw.keyslot(keys.followups("conv_1")) == raw.keyslot(keys.events("conv_1"))
    assert await raw.exists(keys.followups("conv_1")) == 1
