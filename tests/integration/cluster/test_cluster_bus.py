"""The event bus on a Redis Cluster (RUNS.md S-01), beyond the ``EventBus`` contract that
tests/integration/test_redis_bus.py runs on it: where keys land, one wake listener per master,
workers sharing conversations, and what brings a follower back after a lost wake or connection."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import pytest
from redis.asyncio.cluster import RedisCluster

from app.streaming.bus import BusUnavailableError, EventOrderError
from app.streaming.redis_cluster_bus import RedisClusterEventBus
from app.streaming.redis_keys import RedisKeys
from tests.integration.test_redis_bus import collect
from tests.unit.streaming.doubles import stored, wait_until

pytestmark = pytest.mark.redis

MakeBus = Callable[..., RedisClusterEventBus]


def followed(bus: RedisClusterEventBus, conversation_id: str, followers: int = 1) -> bool:
    sub = bus.subscriptions.get(conversation_id)
    return sub is not None and len(sub.followers) >= followers


async def _clients_named(raw: RedisCluster, name: str) -> dict[str, list[dict[str, str]]]:
    """Connections named ``name`` on each master, by master."""
    out: dict[str, list[dict[str, str]]] = {}
    for node in raw.get_primaries():
        clients = await raw.client_list(target_nodes=node)
        out[node.name] = [c for c in clients if c.get("name") == name]
    return out


async def test_a_conversations_keys_share_one_slot_and_conversations_spread_over_every_master(
    make_bus: MakeBus, raw: RedisCluster, cluster: tuple[str, str]
) -> None:
    bus = make_bus()
    keys = RedisKeys(cluster[1], cluster=True)
    conversations = [f"conv_{i}" for i in range(24)]
    for conv in conversations:
        await bus.append(conv, [stored(1)])
        slots = {
            raw.keyslot(key)
            for key in (
                keys.events(conv),
                keys.wake(conv),
                keys.followups(conv),
                keys.signal("cancel", "run_1", conv),
                keys.signal("released", "run_1", conv),
            )
        }
        assert len(slots) == 1, f"the keys of {conv} span slots {slots}"
    masters = set()
    for conv in conversations:
        node = raw.get_node_from_key(keys.events(conv))
        assert await raw.exists(keys.events(conv)) == 1
        masters.add(node.name)
    assert len(masters) == len(raw.get_primaries()) == 3


def test_without_cluster_the_keys_keep_the_names_of_earlier_versions() -> None:
    keys = RedisKeys("agentstream")
    assert keys.events("c1") == "agentstream:events:c1"
    assert keys.followups("c1") == "agentstream:followups:c1"
    assert keys.signal_channel("cancel") == "agentstream:cancel"
    assert keys.signal("cancel", "r1", "c1") == "agentstream:cancel:r1"
    assert keys.signal("released", "r1") == "agentstream:released:r1"


async def test_followers_of_conversations_on_every_master_share_one_wake_connection_per_master(
    make_bus: MakeBus, raw: RedisCluster
) -> None:
    name = f"bus-{secrets.token_hex(4)}"
    bus = make_bus(client_name=name)
    convs = [f"conv_{i}" for i in range(30)]
    readers = [asyncio.create_task(collect(bus, "0-0", 3, conv=c)) for c in convs for _ in range(2)]
    await wait_until(lambda: all(followed(bus, c, 2) for c in convs))

    async def subscribed_channels() -> list[list[int]]:
        """Per master, the channel counts of this bus's subscribed connections."""
        by_master = await _clients_named(raw, name)
        return sorted([int(c["ssub"]) for c in clients if c["ssub"] != "0"] for clients in by_master.values())

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while [len(counts) for counts in await subscribed_channels()] != [1, 1, 1] or sum(
        sum(counts) for counts in await subscribed_channels()
    ) != len(convs):
        assert loop.time() < deadline, f"wake subscriptions: {await subscribed_channels()}"
        await asyncio.sleep(0.02)
    for conv in convs:
        await bus.append(conv, [stored(1), stored(2)])
    await asyncio.gather(*(bus.append(conv, [stored(3)]) for conv in convs))
    results = await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert all(r == [stored(1), stored(2), stored(3)] for r in results)
    await wait_until(lambda: not bus.subscriptions)  # unsubscribed as the followers left


async def test_a_conversation_written_by_one_worker_is_followed_through_another(make_bus: MakeBus) -> None:
    writer, reader = make_bus(), make_bus()
    events = [stored(n) for n in range(1, 101)]
    await writer.append("conv_a", events[:30])
    task = asyncio.create_task(collect(reader, "0-0", 100, conv="conv_a"))
    for start in range(30, 100, 7):
        await writer.append("conv_a", events[start : start + 7])
        await asyncio.sleep(0)
    assert await asyncio.wait_for(task, 10) == events
    # The next run's worker may be the other one; ids are checked across writers.
    with pytest.raises(EventOrderError):
        await reader.append("conv_a", [stored(100)])
    await reader.append("conv_a", [stored(101)])
    assert await writer.last_id("conv_a") == stored(101).id


async def test_an_entry_whose_wake_was_lost_reaches_followers_with_the_sweep(
    make_bus: MakeBus, raw: RedisCluster, cluster: tuple[str, str]
) -> None:
    bus = make_bus(sweep_s=0.3)
    task = asyncio.create_task(collect(bus, "0-0", 2))
    await wait_until(lambda: followed(bus, "conv_1"))
    key = RedisKeys(cluster[1], cluster=True).events("conv_1")
    # Appended as if its SPUBLISH never arrived (a master that died right after the XADD).
    for n in (1, 2):
        event = stored(n)
        await raw.xadd(key, {"event": event.event, "data": event.data, "run_id": event.run_id}, id=event.id)
    assert await asyncio.wait_for(task, 5) == [stored(1), stored(2)]


async def test_follow_survives_dropped_wake_and_read_connections_without_gap_or_duplicate(
    make_bus: MakeBus, raw: RedisCluster
) -> None:
    name = f"bus-{secrets.token_hex(4)}"
    bus, writer = make_bus(client_name=name), make_bus()
    convs = [f"conv_{i}" for i in range(6)]
    events = [stored(n) for n in range(1, 41)]
    readers = [asyncio.create_task(collect(bus, "0-0", 40, conv=c)) for c in convs]
    await wait_until(lambda: all(followed(bus, c) for c in convs))
    for conv in convs:
        await writer.append(conv, events[:10])
    killed = 0
    for master, clients in (await _clients_named(raw, name)).items():
        for client in clients:
            node = raw.get_node(node_name=master)
            await raw.execute_command("CLIENT", "KILL", "ID", client["id"], target_nodes=node)
            killed += 1
    assert killed >= 3  # at least the wake listener of each master
    for start in (10, 20, 30):
        for conv in convs:
            await writer.append(conv, events[start : start + 10])
    results = await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert all(result == events for result in results)


async def test_an_unreachable_cluster_is_unavailable_not_an_error() -> None:
    bus = RedisClusterEventBus("redis://127.0.0.1:1", "agentstream-test:nowhere", socket_timeout_s=0.5)
    try:
        assert await bus.ping() is False
        with pytest.raises(BusUnavailableError):
            await bus.append("conv_1", [stored(1)])
        with pytest.raises(BusUnavailableError):
            await bus.read_after("conv_1", "0-0")
    finally:
        await bus.close()
