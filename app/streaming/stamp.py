"""An event's id and its payload as it is sent and stored (the publisher's, and those of events
published outside any attempt: a run's ``queued`` phase, a replay's start)."""

from __future__ import annotations

import time

import orjson

from app.engine.events import EngineEvent
from app.streaming.bus import StoredEvent, next_cursor


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def encode_event(event: EngineEvent, run_id: str) -> str:
    """An event's ``data`` as it is sent and stored: its payload with its run's id."""
    data = event.data()
    data["run_id"] = run_id
    # A tool may hand back arguments JSON cannot hold (sets, objects): show them as text rather
    # than fail the run.
    return orjson.dumps(data, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def stamp_after(event: EngineEvent, run_id: str, after: str) -> StoredEvent:
    """``event`` of run ``run_id`` as the next event of its conversation after cursor ``after``,
    for an event published outside any attempt (a run's ``queued`` phase)."""
    return StoredEvent(
        next_cursor(after, wall_clock_ms()), event.channel, encode_event(event, run_id), run_id, after
    )
