"""How a run is closed: its ``done`` stored in the transaction that closes its row, whoever closes it.

A run is closed by the attempt that ran it to its end, or, when no attempt can carry it on (it was
cancelled between attempts, its attempts kept dying), by the worker that took it over. Either way
the close is fenced by the run's attempt: an attempt that lost the run can no longer close it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import orjson

from app.db.errors import EventIdTakenError, database_unreachable
from app.db.repositories import RunRepo
from app.engine.events import RunDone
from app.llm.base import ChatMessage
from app.runs.follow_ups import DurableInterruptQueue
from app.streaming.bus import StoredEvent
from app.streaming.publisher import RunPublisher

log = logging.getLogger("app.runs")

T = TypeVar("T")

CLOSE_RETRY_S = 120.0
"""How long a finished run waits for an unreachable database to store its end (as the publisher)."""
CLOSE_ID_ATTEMPTS = 3
"""How many ids a run's done may try when another process stored an event under the one it took."""


async def close_row(
    runs: RunRepo,
    run_id: str,
    attempt: int,
    conversation_id: str,
    done: RunDone,
    stamped: StoredEvent,
    messages: Sequence[ChatMessage],
    follow_ups_through: int | None,
) -> bool:
    """Close the run's row as ``done`` says, with ``messages`` and the stamped done itself, if
    ``attempt`` still holds it; the follow-ups it took (up to ``follow_ups_through``) go with it."""
    return await runs.finish(
        run_id,
        status=done.status,
        answer=done.answer,
        iterations=done.iterations,
        usage=dict(done.usage),
        elapsed=done.elapsed,
        error=done.error,
        pending_injections=list(done.pending_injections),
        messages=messages,
        conversation_id=conversation_id,
        done=stamped,
        attempt=attempt,
        follow_ups_through=follow_ups_through,
    )


async def while_unreachable(write: Callable[[], Awaitable[T]]) -> T:
    """``write()``, tried again while the database is unreachable, for up to ``CLOSE_RETRY_S``.

    A run that ends during a database outage is then still closed, with its done, once the
    database is back, instead of being left to another worker as lost.
    """
    deadline = time.monotonic() + CLOSE_RETRY_S
    attempt = 0
    while True:
        try:
            return await write()
        except Exception as exc:
            if not database_unreachable(exc) or time.monotonic() > deadline:
                raise
            log.warning("database unreachable while closing the run; retrying", extra={"error": repr(exc)})
            attempt += 1
            await asyncio.sleep(min(2.0, 0.05 * 2.0**attempt))


async def drain_quietly(queue: DurableInterruptQueue) -> list[str]:
    """The follow-ups the run has not taken, or none while the database is unreachable: a run must
    still end with its done during an outage (they stay queued for the next run then)."""
    try:
        return await queue.drain()
    except Exception as exc:
        log.warning("could not drain the interrupt queue", extra={"error": repr(exc)})
        return []


async def close_with_done(
    publisher: RunPublisher, done: RunDone, close: Callable[[StoredEvent], Awaitable[bool]]
) -> tuple[bool, StoredEvent]:
    """``close(done as stamped)``, stamped again under the next id if another process took that one
    (the close kept nothing then): whether the run was closed, and the done as stored."""
    for _ in range(CLOSE_ID_ATTEMPTS - 1):
        stamped = publisher.stamp(done)
        try:
            return await close(stamped), stamped
        except EventIdTakenError as exc:
            log.warning("the done's event id was taken; stamping it again", extra={"error": str(exc)})
    stamped = publisher.stamp(done)
    return await close(stamped), stamped


def progress(events: list[StoredEvent]) -> tuple[str, int]:
    """A run's answer so far and the last iteration it reached, from its events: the answer is the
    deltas after its last ``resumed`` phase (RUNS.md R-04), as a client that followed it holds it."""
    parts: list[str] = []
    iterations = 0
    for event in events:
        if event.event not in ("answer", "step", "phase"):
            continue
        data = orjson.loads(event.data)
        if event.event == "phase":
            if data.get("phase") == "resumed":
                parts.clear()
        elif event.event == "answer" and data.get("status") == "delta":
            parts.append(str(data.get("content", "")))
        elif isinstance(data.get("iteration"), int):
            iterations = max(iterations, data["iteration"])
    return "".join(parts), iterations
