"""``POST /api/ag-ui``: AgentStream as an AG-UI agent (FACES.md G-01..G-05).

A request names a thread (``threadId``: per owner, one conversation, created at first use with the
earlier messages as its history) and brings the client's whole history. What it means depends on
what the thread's conversation has and waits for:

- it settles what the thread's run waits for (``resume`` entries, ``tool`` messages answering its
  pending client calls): the same run goes on in this response, which starts with a snapshot;
- it asks a question (the last user message, if the conversation lacks it): a new run, streamed
  (with no final ``MESSAGES_SNAPSHOT`` when the client held the thread and the run's events told it
  all: app.api.faces.agui.translate);
- it brings nothing new while the run waits: the response says again what it waits for;
- it brings nothing at all: the thread's snapshot.

Refusals store nothing. A body that is not a ``RunAgentInput``, a question without text, client
tools the service cannot offer (C-01) or agent settings it cannot take are 422 in the service's
error shape; a question while the thread's run is active is 409 ``run_active``; a resume that
misses an open interrupt, names an unknown one or carries a bad payload is ``RUN_STARTED`` then
``RUN_ERROR {code: "invalid_resume"}`` (G-04).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ag_ui.core import BaseEvent
from ag_ui.encoder import EventEncoder
from fastapi import APIRouter
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from app.api.deps import OwnerDep, ServicesDep
from app.api.faces.agui.reducer import ClientMessages
from app.api.faces.agui.requests import (
    AgUiRunInput,
    AssistantIn,
    DeveloperIn,
    OtherMessageIn,
    SystemIn,
    ToolMessageIn,
    UserIn,
    agent_settings,
    declares_protocol_1,
    text_of,
)
from app.api.faces.agui.resume import Refusal, settle, settlement
from app.api.faces.agui.snapshot import RunFold, Thread, ThreadView, client_results
from app.api.faces.agui.translate import Translator, parks_at
from app.api.faces.follow import face_stream, follow_run, is_waiting
from app.api.routes.conversations import check_client_tools, checked_agent
from app.api.routes.stream import title_from
from app.api.schemas import MAX_MESSAGE_CHARS, AgentSpec, error_responses
from app.container import Services
from app.db.repositories import RunRecord
from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.run_start import Placement
from app.errors import InvalidInputError, RunActiveConflict
from app.llm.base import ChatMessage, ToolCall

router = APIRouter(tags=["ag-ui"])
log = logging.getLogger("app.api.faces")

FACE = "ag-ui"
_ENCODER = EventEncoder()
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
"""One AG-UI event of the response: ``data: <the event as JSON>``."""


def _encoded(event: BaseEvent) -> bytes:
    return _ENCODER.encode(event).encode()


@router.post(
    "/api/ag-ui",
    responses={
        **error_responses(400, 401, 409, 413, 422, 429, 503),
        200: {
            "description": "AG-UI events (RUN_STARTED first; RUN_FINISHED or RUN_ERROR last)",
            "content": {
                "text/event-stream": {"schema": {"type": "array", "items": _EVENT}, "itemSchema": _EVENT}
            },
        },
    },
    response_model=None,
    response_class=EventSourceResponse,
)
async def run_agent(body: AgUiRunInput, services: ServicesDep, owner: OwnerDep) -> EventSourceResponse:
    conversation = await services.threads.find(owner, FACE, body.thread_id)
    view = ThreadView(services, conversation) if conversation is not None else None
    thread = await view.read() if view is not None else None
    known = thread.known_ids if thread is not None else set()
    question = _question(body, known)
    active = await services.runs.active(conversation.id) if conversation is not None else None
    approvals, calls = await services.approvals.waiting_of(active.id) if active is not None else ([], [])
    if active is not None and question is not None:
        raise RunActiveConflict(
            "a run of this thread is active; answer what it waits for, or wait for its end"
        )
    start = _Response(services, body)
    try:
        plan = await settlement(
            services,
            conversation.id if conversation is not None else None,
            approvals=approvals,
            calls=calls,
            entries=body.resume or (),
            tool_messages=[m for m in body.messages if isinstance(m, ToolMessageIn)],
            known=known,
            other_runs=thread.other_runs if thread is not None else (),
        )
    except Refusal as exc:
        return start.refused(exc)
    if plan:
        assert active is not None and view is not None  # only a run's pending records settle
        await settle(services, plan, owner)
        return start.follow(view, active, settled=plan.ids)
    if active is not None:
        if not approvals and not calls:
            raise RunActiveConflict(
                "a run of this thread is active and waits for nothing a request can bring"
            )
        assert view is not None
        return start.waits(view, active, approvals, calls)
    if question is None:
        return start.idle(view)
    text = _question_text(question)
    synced = _holds_thread(body, thread, question)
    tools = _client_tools(services, body)
    agent = checked_agent(services, _agent_spec(body)) if conversation is None else {}
    created = False
    if conversation is None:
        conversation, created = await services.threads.open(
            owner,
            FACE,
            body.thread_id,
            title=title_from(text),
            agent_config=agent,
            history=_history(body, question),
        )
        view = ThreadView(services, conversation)
    assert view is not None
    try:
        run = await services.manager.start_run(
            conversation,
            text,
            prior=_context(body),
            placement=Placement(client_id=question.id),
            client_tools=tools,
        )
    except Exception:
        if created:  # refused (the queue is full, the worker stops, an outage): the new thread goes too
            await _forget(services, owner, conversation.id)
        raise
    return start.follow(view, run, synced=synced)


async def _forget(services: Services, owner: str, conversation_id: str) -> None:
    """Remove the conversation this request created for a run that did not start: a refused
    request changes nothing stored (its face thread goes with it)."""
    try:
        await services.conversations.delete(owner, conversation_id)
    except Exception as exc:
        log.warning(
            "could not remove the conversation of a run that did not start",
            extra={"conversation_id": conversation_id, "error": repr(exc)},
        )


class _Response:
    """The response's stream, in its few shapes."""

    def __init__(self, services: Services, body: AgUiRunInput) -> None:
        self.services = services
        self.body = body
        self.protocol_1 = declares_protocol_1(body)

    def _translator(self, view: ThreadView | None, fold: RunFold, **options: Any) -> Translator:
        return Translator(
            view,
            thread_id=self.body.thread_id,
            run_id=self.body.run_id,
            protocol_1=self.protocol_1,
            fold=fold,
            **options,
        )

    def _stream(self, events: AsyncIterator[BaseEvent]) -> EventSourceResponse:
        async def body() -> AsyncIterator[bytes]:
            async for event in events:
                yield _encoded(event)

        return face_stream(self.services, body())

    def refused(self, refusal: Refusal) -> EventSourceResponse:
        translator = self._translator(None, RunFold(""))

        async def events() -> AsyncIterator[BaseEvent]:
            yield translator.started()
            for event in translator.error(refusal.code, refusal.message):
                yield event

        return self._stream(events())

    def idle(self, view: ThreadView | None) -> EventSourceResponse:
        """Nothing to run: the thread as it is (nothing at all for a thread never used)."""
        translator = self._translator(view, RunFold(""))

        async def events() -> AsyncIterator[BaseEvent]:
            yield translator.started()
            if view is not None:
                yield await translator.snapshot()
            yield translator.finished()

        return self._stream(events())

    def waits(
        self,
        view: ThreadView,
        run: RunRecord,
        approvals: Sequence[ApprovalRecord],
        calls: Sequence[ApprovalRecord],
    ) -> EventSourceResponse:
        """The run still waits and the request settles nothing: what it waits for, again."""

        async def events() -> AsyncIterator[BaseEvent]:
            translator = self._translator(view, await view.fold(run.id))
            yield translator.started()
            for event in await translator.park(approvals, calls):
                yield event

        return self._stream(events())

    def follow(
        self,
        view: ThreadView,
        run: RunRecord,
        settled: Sequence[str] | set[str] = (),
        synced: bool = False,
    ) -> EventSourceResponse:
        """The run's events from its start; a continuation (``settled``: the ids it settled)
        speaks from its park on. At a ``waiting`` that still waits the response parks, unless what
        it waits for was settled in the moment between: then the run goes on, and so does this.
        ``synced``: the client sent the thread as it was before the run (see ``Translator``)."""
        services = self.services
        client = _client_messages(self.body) if synced else None

        async def events() -> AsyncIterator[BaseEvent]:
            held = client_results(await services.approvals.of_run(run.id)) if settled else {}
            options = {"settled": sorted(settled), "held": sorted(held), "synced": synced, "client": client}
            translator = self._translator(view, RunFold(run.id), **options)
            yield translator.started()
            cursor: str | None = None
            try:
                while not translator.ended:
                    last = None
                    async for stored in follow_run(services, run, after=cursor):
                        last = stored
                        for event in await translator.feed(stored):
                            yield event
                    if translator.ended or last is None or not is_waiting(last):
                        break
                    approvals, calls = await services.approvals.waiting_of(run.id)
                    if parks_at(last, approvals, calls):
                        for event in await translator.park(approvals, calls):
                            yield event
                        break
                    cursor = last.id
            except Exception as exc:
                log.warning("ag-ui stream ended early", extra={"run_id": run.id, "error": type(exc).__name__})
            if not translator.ended:
                message = "the service stopped streaming before the run ended; the run goes on"
                for event in translator.error("stream_interrupted", message):
                    yield event

        return self._stream(events())


def _question(body: AgUiRunInput, known: set[str]) -> UserIn | None:
    """The last user message, if the conversation lacks it: the run's question (G-02)."""
    last = next((m for m in reversed(body.messages) if isinstance(m, UserIn)), None)
    return last if last is not None and last.id not in known else None


def _sent_ids(body: AgUiRunInput) -> list[str]:
    """The ids of the messages the client sent, of the roles a snapshot holds (an ``activity``
    message, or one of a role this service does not know, stays with the client)."""
    return [m.id for m in body.messages if not isinstance(m, OtherMessageIn)]


def _holds_thread(body: AgUiRunInput, thread: Thread | None, question: UserIn) -> bool:
    """Whether the client sent the thread as it is (its messages' ids, in order) and then the
    question as the thread stores it (its text): after the run's events it holds what a snapshot
    would say. A new thread's history is stored as the service reads it (text, the roles it
    knows), a question of parts as their text: then the response ends with the snapshot."""
    before = [m.id for m in thread.messages] if thread is not None else []
    return isinstance(question.content, str) and _sent_ids(body) == [*before, question.id]


def _client_messages(body: AgUiRunInput) -> ClientMessages:
    """What follows the messages a response's events add to the client's history (every id it
    holds, an ``activity`` message's too)."""
    ids = [getattr(m, "id", None) for m in body.messages]
    calls = [c.id for m in body.messages if isinstance(m, AssistantIn) for c in m.tool_calls or ()]
    return ClientMessages([i for i in ids if isinstance(i, str)], calls)


def _question_text(question: UserIn) -> str:
    text = text_of(question.content)
    if not text.strip():
        raise InvalidInputError(f"message {question.id} has no text to ask")
    if len(text) > MAX_MESSAGE_CHARS:
        raise InvalidInputError(f"message {question.id} is longer than {MAX_MESSAGE_CHARS} characters")
    return text


def _client_tools(services: Services, body: AgUiRunInput) -> list[dict[str, object]] | None:
    """The request's ``tools``: tools the client runs, for this run (C-01)."""
    tools = [
        {
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters or {"type": "object", "properties": {}},
        }
        for t in body.tools or ()
    ]
    for tool in tools:
        if not isinstance(tool["parameters"], dict):
            raise InvalidInputError(f"client tool {tool['name']!r}: parameters must be a JSON Schema object")
    check_client_tools(services, tools)
    return tools or None


def _agent_spec(body: AgUiRunInput) -> AgentSpec | None:
    settings = agent_settings(body)
    if settings is None:
        return None
    try:
        return AgentSpec.model_validate(settings)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem.get("loc", ()))
        raise InvalidInputError(f"forwardedProps.agent.{where}: {problem.get('msg')}") from None


def _context(body: AgUiRunInput) -> list[ChatMessage]:
    """``context`` entries, given to the model with the question (stored before it)."""
    if not body.context:
        return []
    lines = "\n".join(f"- {c.description}: {c.value}" for c in body.context)
    return [ChatMessage(role="system", content=f"Context from the application:\n{lines}")]


def _history(body: AgUiRunInput, question: UserIn) -> list[tuple[ChatMessage, str | None]]:
    """A new thread's earlier messages (those before its question), with the client's ids."""
    out: list[tuple[ChatMessage, str | None]] = []
    for message in body.messages:
        if message is question:
            break
        if isinstance(message, UserIn):
            out.append((ChatMessage(role="user", content=text_of(message.content)), message.id))
        elif isinstance(message, AssistantIn):
            calls = tuple(
                ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments or "{}")
                for c in message.tool_calls or ()
            )
            out.append((ChatMessage(role="assistant", content=message.content, tool_calls=calls), message.id))
        elif isinstance(message, ToolMessageIn):
            chat = ChatMessage(
                role="tool", content=text_of(message.content), tool_call_id=message.tool_call_id
            )
            out.append((chat, message.id))
        elif isinstance(message, SystemIn | DeveloperIn):
            out.append((ChatMessage(role="system", content=message.content), message.id))
    return out
