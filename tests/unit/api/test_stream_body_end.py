"""A stream whose store fails after the 200 went out ends its body cleanly (the client resumes),
unless the bus can carry it on alone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from app.api.routes.stream import _encoded
from app.observability import Metrics
from app.streaming.bus import StoredEvent
from app.streaming.memory import MemoryEventBus


class _FailingStore:
    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[Any]:
        raise ConnectionError("database went away")


async def test_a_store_failure_mid_stream_ends_the_body_instead_of_raising() -> None:
    metrics = Metrics()
    bus = MemoryEventBus()
    # The bus's first entry names an event before it that the bus does not hold: only the
    # database could fill that hole, and it is away.
    await bus.append("conv_x", [StoredEvent("9-0", "step", "{}", "run_1", prev="5-0")])
    services: Any = SimpleNamespace(metrics=metrics, bus=bus, events=_FailingStore())

    chunks = [chunk async for chunk in _encoded(services, "conv_x", "0-0")]

    assert chunks == []
    assert metrics.registry.get_sample_value("agentstream_active_streams") == 0


async def test_with_the_store_away_a_caught_up_stream_follows_the_bus() -> None:
    bus = MemoryEventBus()
    services: Any = SimpleNamespace(metrics=Metrics(), bus=bus, events=_FailingStore())

    async def publish_later() -> None:
        await asyncio.sleep(0)
        await bus.append(
            "conv_x",
            [
                StoredEvent("7-0", "step", '{"type":"thinking"}', "run_1", prev="0-0"),
                StoredEvent("7-1", "done", '{"status":"completed"}', "run_1", prev="7-0"),
            ],
        )

    task = asyncio.create_task(publish_later())
    chunks = [chunk async for chunk in _encoded(services, "conv_x", "0-0")]
    await task

    assert [chunk.split(b"\n", 1)[0] for chunk in chunks] == [b"id: 7-0", b"id: 7-1"]
