"""A stream whose store fails after the 200 went out ends its body cleanly (the client resumes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from app.api.routes.stream import _encoded
from app.observability import Metrics
from app.streaming.memory import MemoryEventBus


class _FailingStore:
    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[Any]:
        raise ConnectionError("database went away")


async def test_a_store_failure_mid_stream_ends_the_body_instead_of_raising() -> None:
    metrics = Metrics()
    services: Any = SimpleNamespace(metrics=metrics, bus=MemoryEventBus(), events=_FailingStore())

    chunks = [chunk async for chunk in _encoded(services, "conv_x", "0-0")]

    assert chunks == []
    assert metrics.registry.get_sample_value("agentstream_active_streams") == 0
