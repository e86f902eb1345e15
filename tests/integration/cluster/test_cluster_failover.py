"""A master's failover mid-run loses no event (RUNS.md S-01), on a private cluster of this module.

The master serving a conversation's slot is killed (SIGKILL) while a writer appends and a reader
streams the conversation (``app.streaming.resume.stream_events``, as the SSE route does). The
writer retries as the publisher does (``app.streaming.publisher``: store first, then the bus,
re-appending after a failure what the bus does not hold); the reader must end with every event
exactly once and in order, whatever the bus lost in between being served from the store.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace
from pathlib import Path

import pytest

from app.streaming.bus import BusUnavailableError, EventBus, EventOrderError, StoredEvent, parse_cursor
from app.streaming.redis_cluster_bus import RedisClusterEventBus
from app.streaming.redis_keys import RedisKeys
from app.streaming.resume import stream_events
from tests.support.redis_cluster import PrivateCluster
from tests.unit.streaming.doubles import MemoryStore, done, stored

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]

CONV = "conv_failover"


def _chain(count: int) -> list[StoredEvent]:
    events = [stored(n) for n in range(1, count)] + [done(count)]
    return [replace(e, prev=events[i - 1].id if i else None) for i, e in enumerate(events)]


async def _publish(bus: EventBus, store: MemoryStore, batch: list[StoredEvent], deadline: float) -> None:
    """As ``RunPublisher._send``: after a failure, skip what the bus holds and append the rest."""
    loop = asyncio.get_running_loop()
    await store.save(CONV, batch)
    failed = False
    while True:
        try:
            if failed:
                held = await bus.last_id(CONV)
                if held is not None:
                    batch = [e for e in batch if parse_cursor(e.id) > parse_cursor(held)]
            if batch:
                await bus.append(CONV, batch)
            return
        except (BusUnavailableError, EventOrderError):
            assert loop.time() < deadline, "the bus never came back after the failover"
            failed = True
            await asyncio.sleep(0.1)


async def test_a_reader_gets_every_event_once_and_in_order_across_a_master_failover(
    private_cluster: PrivateCluster, tmp_path: Path
) -> None:
    prefix = f"agentstream-test:{secrets.token_hex(6)}"
    key = RedisKeys(prefix, cluster=True).events(CONV)
    writer = RedisClusterEventBus(private_cluster.url, prefix, socket_timeout_s=1.0)
    reader_bus = RedisClusterEventBus(private_cluster.url, prefix, socket_timeout_s=1.0, sweep_s=1.0)
    store = MemoryStore()
    events = _chain(300)
    got: list[StoredEvent] = []

    async def read() -> None:
        async for event in stream_events(reader_bus, store, CONV, "0-0", outage_poll_s=0.2, seam_wait_s=1.0):
            got.append(event)

    loop = asyncio.get_running_loop()
    reading = asyncio.create_task(read())
    try:
        killed: int | None = None
        for start in range(0, len(events), 5):
            await _publish(writer, store, events[start : start + 5], loop.time() + 60)
            if start == 100:
                killed = await asyncio.to_thread(private_cluster.kill_master_of, key)
            await asyncio.sleep(0.01)  # a run's pace: the failover happens while it goes on
        await asyncio.wait_for(reading, 60)
        assert [e.id for e in got] == [e.id for e in events]
        assert got == events
        # The replica took the slot over, and the bus writes there now.
        assert killed is not None
        assert await asyncio.to_thread(private_cluster.master_port_of, key) != killed
        assert await writer.last_id(CONV) == events[-1].id
    finally:
        reading.cancel()
        await writer.close()
        await reader_bus.close()
