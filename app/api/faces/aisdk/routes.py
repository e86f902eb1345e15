"""The AI SDK face (FACES.md V-01..V-07): ``useChat`` with ``DefaultChatTransport`` pointed at
``/api/ai-sdk/chat`` works unmodified.

- ``POST /api/ai-sdk/chat``: a new run, an edit, a regenerate, or the continuation of a waiting
  run's message; answered with the UI message stream of that run, until it ends or waits.
- ``GET /api/ai-sdk/chat/{id}/stream``: the streaming run's whole message again, then live (204
  when nothing streams: ``resume: true`` calls it on every page load).
- ``GET /api/ai-sdk/chat/{id}/messages``: the chat's current branch as ``UIMessage[]``.
- ``POST /api/ai-sdk/chat/{id}/stop``: cancels the chat's active run (closing the fetch never does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response, status

from app.api.deps import OwnerDep, ServicesDep
from app.api.faces.aisdk.chunks import MessageChunks
from app.api.faces.aisdk.continuation import ResponseChunks
from app.api.faces.aisdk.messages import client_outputs, ui_messages
from app.api.faces.aisdk.requests import FACE, ChatIn, ClientId, GoesOn, chat_of, meaning
from app.api.faces.follow import face_stream, follow_run, frame
from app.api.schemas import Accepted, error_responses
from app.api.sse_response import EventStream
from app.container import Services
from app.db.repositories import RunRecord
from app.errors import NotFoundError, ServiceError

router = APIRouter(tags=["ai-sdk"])

STREAM_HEADERS = {"x-vercel-ai-ui-message-stream": "v1"}
DONE = b"data: [DONE]\n\n"
UI_STREAM = {
    "text/event-stream": {
        "schema": {"type": "string", "description": "AI SDK UI message chunks, one `data:` frame each"}
    }
}


async def _message(
    services: Services, run: RunRecord, *, settled: frozenset[str] = frozenset()
) -> AsyncIterator[bytes]:
    """The run's message as chunks: from its ``start`` (a new run, a resume), or, for a
    continuation that ``settled`` approvals and calls, from where the earlier response ended."""
    response = ResponseChunks(MessageChunks(run.id, client_outputs(services, run.id)), settled)
    for chunk in response.opening():
        yield frame(chunk)
    async for event in follow_run(services, run):
        for chunk in await response.event(event):
            yield frame(chunk)
    for chunk in response.closing():
        yield frame(chunk)
    yield DONE


def _stream(services: Services, body: AsyncIterator[bytes]) -> EventStream:
    return face_stream(services, body, STREAM_HEADERS.items())


@router.post(
    "/api/ai-sdk/chat",
    responses={
        **error_responses(400, 401, 404, 409, 413, 422, 429, 503),
        200: {"description": "the run's UI message stream, until it ends or waits", "content": UI_STREAM},
    },
    response_model=None,
    response_class=EventStream,
)
async def chat(body: ChatIn, services: ServicesDep, owner: OwnerDep) -> EventStream:
    conv, created = await chat_of(services, owner, body)
    meant = await meaning(services, owner, conv, body)
    if isinstance(meant, GoesOn):
        return _stream(services, _message(services, meant.run, settled=meant.settled))
    try:
        run = await services.manager.start_run(conv, meant.text, placement=meant.placement)
    except ServiceError:
        if created:  # refused (the queue is full, the worker stops): the new chat goes too
            await services.conversations.delete(owner, conv.id)
        raise
    return _stream(services, _message(services, run))


@router.get(
    "/api/ai-sdk/chat/{chat_id}/stream",
    responses={
        **error_responses(401, 422),
        200: {"description": "the streaming run's whole message, then live", "content": UI_STREAM},
        204: {"description": "no run of this chat is streaming (one waiting for a person is not)"},
    },
    response_model=None,
    response_class=EventStream,
)
async def resume(chat_id: ClientId, services: ServicesDep, owner: OwnerDep) -> Response:
    conv = await services.threads.find(owner, FACE, chat_id)
    run = await services.runs.active(conv.id) if conv is not None else None
    if run is None or run.status == "waiting":
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return _stream(services, _message(services, run))


@router.get(
    "/api/ai-sdk/chat/{chat_id}/messages",
    responses=error_responses(401, 422),
    response_model=list[dict[str, Any]],
)
async def messages(chat_id: ClientId, services: ServicesDep, owner: OwnerDep) -> list[dict[str, Any]]:
    """The chat's current branch as the AI SDK's ``UIMessage[]`` (empty for a chat not used yet)."""
    conv = await services.threads.find(owner, FACE, chat_id)
    return await ui_messages(services, conv) if conv is not None else []


@router.post(
    "/api/ai-sdk/chat/{chat_id}/stop",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=Accepted,
    responses=error_responses(401, 404, 409, 422),
)
async def stop(chat_id: ClientId, services: ServicesDep, owner: OwnerDep) -> Accepted:
    conv = await services.threads.find(owner, FACE, chat_id)
    if conv is None:
        raise NotFoundError("chat not found")
    run = await services.manager.cancel(conv)
    return Accepted(run_id=run.id, status="cancelling")
