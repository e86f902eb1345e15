"""The conversation's event stream (SSE) and the curl convenience route ``POST /api/chat``."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response, status
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.deps import OwnerDep, ServicesDep, StreamOwnerDep
from app.api.routes.conversations import owned_conversation
from app.api.schemas import ChatRequest, error_responses, optional_parameter
from app.api.sse_response import EventStream
from app.container import Services
from app.errors import InvalidInputError
from app.streaming.bus import ZERO_CURSOR, StoredEvent, format_cursor, parse_cursor
from app.streaming.resume import stream_events
from app.streaming.sse import encode_event

router = APIRouter(tags=["stream"])
log = logging.getLogger("app.api.stream")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ACCESS_TOKEN_CHARS = 16 * 1024
# A client that stops reading for this long is dropped, so its buffers cannot grow without bound;
# it reconnects with its cursor and loses nothing.
SEND_TIMEOUT_S = 60.0
# Where the bus shows a hole after a client's cursor (Redis lost events), how long to wait for the
# database to store what lies in between (app.streaming.resume). The wait ends as soon as the
# database holds anything after the cursor: the events of the hole, or, if they are really lost,
# the bus entry after it (every event is queued for the database before it is sent to the bus).
# So it only runs long while the database is behind or down, and then waiting is right: this
# bound matches how long a publisher retries the database (store_retry_s) before it drops a batch.
SEAM_WAIT_S = 120.0
# How long after a run's close a reconnect right before its done still waits for that done.
DONE_PENDING_S = 10.0


def ping_event() -> ServerSentEvent:
    """``: ping`` with the same LF line ends as the events (sse-starlette's default is CRLF)."""
    return ServerSentEvent(comment="ping", sep="\n")


# One event of the stream as OpenAPI 3.2's ``itemSchema`` describes it (API.md, "The event stream").
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+-[0-9]+$"},
        "event": {"enum": ["step", "answer", "compact", "phase", "inject", "approval", "done"]},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
}
# ``schema`` is the whole stream read as a list of events, as OpenAPI 3.2 has it for sequential media.
SSE_CONTENT = {
    "text/event-stream": {
        "schema": {"type": "array", "items": SSE_EVENT_SCHEMA},
        "itemSchema": SSE_EVENT_SCHEMA,
    }
}


async def _encoded(services: Services, conversation_id: str, after: str) -> AsyncIterator[bytes]:
    services.metrics.active_streams.inc()
    try:
        async for event in stream_events(
            services.bus, services.events, conversation_id, after, seam_wait_s=SEAM_WAIT_S
        ):
            yield encode_event(event)
    except Exception as exc:
        # The 200 is already sent: end the body cleanly rather than cut it, so the client sees a
        # closed stream and reconnects with its cursor (a database or bus outage mid-stream).
        log.warning(
            "stream ended early; the client will resume",
            extra={"conversation_id": conversation_id, "error": type(exc).__name__},
        )
    finally:
        services.metrics.active_streams.dec()


def sse_response(services: Services, conversation_id: str, after: str) -> EventSourceResponse:
    return EventStream(
        _encoded(services, conversation_id, after),
        headers=SSE_HEADERS,
        ping=services.settings.sse_ping_seconds,
        ping_message_factory=ping_event,
        sep="\n",
        send_timeout=SEND_TIMEOUT_S,
    )


# An event id is "<ms>-<seq>" in ASCII digits (int() alone would take "１２" or " 12 "), within
# what the database's columns hold (BIGINT, INTEGER). The OpenAPI document says so with this
# pattern, where empty means no cursor.
CURSOR_PATTERN = "^([0-9]{1,18}-[0-9]{1,9})?$"
_CURSOR = re.compile(r"([0-9]{1,18})-([0-9]{1,9})")
_MAX_MS = 2**63 - 1
_MAX_SEQ = 2**31 - 1


def _valid_cursor(value: str, source: str) -> str:
    """The canonical form of a client's cursor; ``InvalidInputError`` for anything else."""
    match = _CURSOR.fullmatch(value)
    if match is not None:
        ms, seq = int(match[1]), int(match[2])
        if ms <= _MAX_MS and seq <= _MAX_SEQ:
            return format_cursor(ms, seq)
    raise InvalidInputError(f"{source} must be an event id such as 1700000000000-0")


async def _first_after(services: Services, conversation_id: str, cursor: str) -> StoredEvent | None:
    try:
        held = await services.bus.read_after(conversation_id, cursor, limit=1)
        if held:
            return held[0]
    except Exception:  # bus down: the database decides
        pass
    stored = await services.events.read_after(conversation_id, cursor, limit=1)
    return stored[0] if stored else None


async def _event_at(services: Services, conversation_id: str, cursor: str) -> StoredEvent | None:
    """The event whose id is ``cursor``, if the bus or the database has it."""
    ms, seq = parse_cursor(cursor)
    if seq > 0:
        before = format_cursor(ms, seq - 1)
    elif ms > 0:
        before = format_cursor(ms - 1, _MAX_SEQ)
    else:
        return None
    event = await _first_after(services, conversation_id, before)
    return event if event is not None and event.id == cursor else None


async def _nothing_more(services: Services, conversation_id: str, cursor: str) -> bool:
    """Whether a reconnect at ``cursor`` has nothing more to get (204 stops an EventSource)."""
    if await services.runs.active(conversation_id) is not None:
        return False
    if await _first_after(services, conversation_id, cursor) is not None:
        return False
    # A run's done is stored with its close (RunRepo.finish), so it is found above; this is for
    # a done stored late (a worker of an earlier version closed the row first and published the
    # done after). Long after the close, a done that never came will not come any more.
    latest = await services.runs.latest(conversation_id)
    if latest is None or latest.finished_at is None:
        return True
    if datetime.now(UTC) - latest.finished_at > timedelta(seconds=DONE_PENDING_S):
        return True
    event = await _event_at(services, conversation_id, cursor)
    return event is None or event.is_done


@router.get(
    "/api/conversations/{conversation_id}/stream",
    responses={
        **error_responses(401, 404, 422),
        200: {"description": "the events, until `done`", "content": SSE_CONTENT},
        204: {"description": "nothing more to stream: the latest run is done and was read to its end"},
    },
    response_model=None,
    response_class=EventSourceResponse,
)
async def stream(
    conversation_id: str,
    request: Request,
    services: ServicesDep,
    owner: StreamOwnerDep,
    after: Annotated[str | None, Query(max_length=64), optional_parameter(64, CURSOR_PATTERN)] = None,
    last_event_id: Annotated[
        str | None,
        Header(alias="Last-Event-ID", max_length=64),
        optional_parameter(64, CURSOR_PATTERN),
    ] = None,
    # Access tokens run to 2,000 characters and more (FACES.md J-01: no cap below 8 KiB).
    access_token: Annotated[
        str | None, Query(max_length=ACCESS_TOKEN_CHARS), optional_parameter(ACCESS_TOKEN_CHARS)
    ] = None,
) -> Response:
    del request, access_token  # read by StreamOwnerDep
    conv = await owned_conversation(services, owner, conversation_id)
    # An EventSource reconnect sends Last-Event-ID and may still carry the original ?after=:
    # the header is the newer position (a malformed ?after= is refused all the same).
    cursor: str | None = _valid_cursor(after, "after") if after else None
    if last_event_id:
        cursor = _valid_cursor(last_event_id.strip(), "Last-Event-ID")
    if cursor is None:
        run = await services.runs.active(conv.id) or await services.runs.latest(conv.id)
        # No run yet: the stream waits for the first one (a client may subscribe before it
        # starts a run; a 204 would stop an EventSource for good).
        cursor = run.start_cursor if run is not None else ZERO_CURSOR
    elif await _nothing_more(services, conv.id, cursor):
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return sse_response(services, conv.id, cursor)


def title_from(message: str) -> str:
    """A new chat's title: its first line with text, on one line without control characters."""
    for line in message.splitlines():
        title = " ".join("".join(c if c.isprintable() else " " for c in line).split())
        if title:
            return title[:80]
    return "Chat"


@router.post(
    "/api/chat",
    responses={
        **error_responses(400, 401, 404, 409, 413, 422, 503),
        200: {"description": "the new run's events, until `done`", "content": SSE_CONTENT},
    },
    response_model=None,
    response_class=EventSourceResponse,
)
async def chat(body: ChatRequest, services: ServicesDep, owner: OwnerDep) -> EventSourceResponse:
    if body.conversation_id:
        conv = await owned_conversation(services, owner, body.conversation_id)
        run = await services.manager.start_run(conv, body.message)
    else:
        conv, run = await services.manager.start_in_new_conversation(
            owner, title_from(body.message), {}, body.message
        )
    return sse_response(services, conv.id, run.start_cursor)
