"""What the protocol faces share: a run's events, live, until it ends or stops to wait.

A face answers one request with one response, and a run may outlive many of them: it stops to wait
for a person or for the client's tool result (``phase waiting``, RUNS.md A-02, FACES.md C-02) and
goes on in the response to the request that brings what it waited for. ``follow_run`` yields a
run's events in order, exactly once each, from any cursor (the bus when it can vouch, else the
database: ``app.streaming.resume``), and ends after the run's ``done`` or at a ``waiting`` that
still waits. A ``waiting`` whose approvals and calls were all settled meanwhile is passed by: the
run goes on, and so does the response.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson

from app.api.routes.stream import SEAM_WAIT_S, SEND_TIMEOUT_S, SSE_HEADERS, ping_event
from app.api.sse_response import EventStream
from app.container import Services
from app.db.repositories import RunRecord
from app.streaming.bus import StoredEvent
from app.streaming.resume import stream_events

log = logging.getLogger("app.api.faces")


def payload(event: StoredEvent) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(event.data)
    return data


def is_waiting(event: StoredEvent) -> bool:
    return event.event == "phase" and '"waiting"' in event.data and payload(event).get("phase") == "waiting"


async def still_waits(services: Services, run_id: str, waiting: dict[str, Any]) -> bool:
    """Whether any approval or client call that a ``waiting`` event names is still pending."""
    named = {*waiting.get("approval_ids", ()), *waiting.get("call_ids", ())}
    if not named:
        return False
    approvals, calls = await services.approvals.waiting_of(run_id)
    return any(record.id in named or record.call_id in named for record in [*approvals, *calls])


async def follow_run(
    services: Services, run: RunRecord, after: str | None = None, *, past_waits: bool = False
) -> AsyncIterator[StoredEvent]:
    """The events of ``run`` after ``after`` (default: from its first), in order, live; ends after
    its ``done``, or after a ``waiting`` that still waits (FACES.md V-04, G-04) unless
    ``past_waits`` (the caller stops where it wants)."""
    cursor = after or run.start_cursor
    async for event in stream_events(
        services.bus, services.events, run.conversation_id, cursor, seam_wait_s=SEAM_WAIT_S
    ):
        if event.run_id != run.id:
            continue
        yield event
        if event.is_done:
            return
        if not past_waits and is_waiting(event) and await still_waits(services, run.id, payload(event)):
            return


def frame(chunk: dict[str, Any]) -> bytes:
    """One ``data:`` frame, LF only (the AG-UI client cannot split CRLF frames)."""
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def face_stream(
    services: Services, body: AsyncIterator[bytes], headers: Iterable[tuple[str, str]] = ()
) -> EventStream:
    """The SSE response of a face: ``body``'s frames, ``: ping`` while the run is quiet."""

    async def counted() -> AsyncIterator[bytes]:
        services.metrics.active_streams.inc()
        try:
            async for chunk in body:
                yield chunk
        except Exception as exc:
            # The 200 is sent: end the body cleanly (the client resumes where a face allows it).
            log.warning("face stream ended early", extra={"error": type(exc).__name__})
        finally:
            services.metrics.active_streams.dec()

    return EventStream(
        counted(),
        headers={**SSE_HEADERS, **dict(headers)},
        ping=services.settings.sse_ping_seconds,
        ping_message_factory=ping_event,
        sep="\n",
        send_timeout=SEND_TIMEOUT_S,
    )
