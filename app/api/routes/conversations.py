"""Conversations and the commands on their runs: start, interrupt, cancel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Response, status

from app.api.deps import OwnerDep, ServicesDep
from app.api.presenters import branch_out, conversation_out
from app.api.schemas import (
    Accepted,
    AgentSpec,
    ConversationCreate,
    ConversationDetail,
    ConversationOut,
    ConversationPage,
    InterruptCreate,
    Queued,
    RunCreate,
    RunStarted,
    error_responses,
    is_resource_id,
    optional_parameter,
)
from app.container import Services
from app.db.repositories import ConversationRecord, decode_page_cursor
from app.errors import InvalidInputError, NoActiveRunError, NotFoundError, RunActiveConflict
from app.runs.approvals import approval_item, tool_call_item
from app.runs.branches import question_of
from app.tools.schema_check import schema_errors
from app.webhooks import WebhookRefusedError

router = APIRouter(tags=["conversations"])

IdPath = Annotated[str, "conversation id"]
# What each kind of route can answer besides success (bodies: 400/413/422 too; runs: 409/503).
# 422 is listed wherever FastAPI would document its own validation error, whose shape ours replaces.
ERRORS = error_responses(401, 404, 422)
BODY_ERRORS = error_responses(400, 401, 413, 422)


async def owned_conversation(services: Services, owner: str, conversation_id: str) -> ConversationRecord:
    conv = None
    if is_resource_id(conversation_id):
        conv = await services.conversations.get(owner, conversation_id)
    if conv is None:
        raise NotFoundError("conversation not found")
    return conv


def check_client_tools(services: Services, tools: list[dict[str, Any]]) -> None:
    """Tools the client runs (FACES.md C-01): names of their own, parameters a JSON Schema of an
    object; 422 otherwise."""
    seen: set[str] = set()
    for tool in tools:
        name = tool["name"]
        if name in services.tools:
            raise InvalidInputError(f"client tool {name!r}: the service has a tool of that name")
        if name in seen:
            raise InvalidInputError(f"client tool {name!r} is declared twice")
        seen.add(name)
        parameters = tool.get("parameters") or {}
        problems = schema_errors(parameters)
        if parameters.get("type", "object") != "object":
            problems.insert(0, "its type must be object")
        if problems:
            raise InvalidInputError(
                f"client tool {name!r}: parameters are not a usable JSON Schema: {problems[0]}"
            )


def stream_url(conversation_id: str) -> str:
    return f"/api/conversations/{conversation_id}/stream"


@router.post(
    "/api/conversations",
    status_code=status.HTTP_201_CREATED,
    response_model=ConversationOut,
    responses=BODY_ERRORS,
)
async def create_conversation(
    services: ServicesDep, owner: OwnerDep, body: Annotated[ConversationCreate | None, Body()] = None
) -> ConversationOut:
    body = body or ConversationCreate()
    agent = checked_agent(services, body.agent)
    conv = await services.conversations.create(owner, body.title or "New conversation", agent)
    return conversation_out(conv)


def checked_agent(services: Services, spec: AgentSpec | None) -> dict[str, Any]:
    """A new conversation's agent settings as stored; 422 for tools or a model the service lacks."""
    agent = spec.model_dump(exclude_none=True) if spec else {}
    unknown = [name for name in agent.get("tools", []) if name not in services.tools]
    unknown += [
        name for name in agent.get("require_approval", []) if name != "*" and name not in services.tools
    ]
    if unknown:
        raise InvalidInputError(f"unknown tools: {', '.join(unknown)}; see GET /api/tools")
    if "model" in agent and agent["model"] not in services.models:
        raise InvalidInputError(f"unknown model {agent['model']!r}; see GET /api/models")
    check_client_tools(services, agent.get("client_tools") or [])
    return agent


# Conversations are made now; a cursor's time outside these bounds was not handed out by us, and
# near the ends of the calendar converting it for the database overflows.
_EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
_LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def _check_page_cursor(cursor: str) -> None:
    """Refuse a list cursor this service cannot have handed out, before any SQL sees it."""
    try:
        created_at, conversation_id = decode_page_cursor(cursor)
        valid = _EARLIEST <= created_at.astimezone(UTC) <= _LATEST and is_resource_id(conversation_id)
    except (ValueError, OverflowError):
        valid = False
    if not valid:
        raise InvalidInputError("invalid cursor")


@router.get("/api/conversations", response_model=ConversationPage, responses=error_responses(401, 422))
async def list_conversations(
    services: ServicesDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=256), optional_parameter(256)] = None,
) -> ConversationPage:
    cursor = cursor or None  # ?cursor= (empty) is the first page, as a null next_cursor written out
    if cursor is not None:
        _check_page_cursor(cursor)
    try:
        items, next_cursor = await services.conversations.list(owner, limit, cursor)
    except ValueError as exc:
        raise InvalidInputError("invalid cursor") from exc
    return ConversationPage(items=[conversation_out(c) for c in items], next_cursor=next_cursor)


@router.get("/api/conversations/{conversation_id}", response_model=ConversationDetail, responses=ERRORS)
async def get_conversation(
    conversation_id: IdPath, services: ServicesDep, owner: OwnerDep
) -> ConversationDetail:
    conv = await owned_conversation(services, owner, conversation_id)
    return await conversation_detail(services, conv)


async def conversation_detail(services: Services, conv: ConversationRecord) -> ConversationDetail:
    """The conversation with its current branch and what its active run waits for."""
    messages, head = await services.conversations.branch(conv.id)
    active = await services.runs.active(conv.id)
    pending = await services.approvals.pending(conversation_id=conv.id)
    calls = await services.approvals.pending(conversation_id=conv.id, kind="client")
    return ConversationDetail(
        **conversation_out(conv).model_dump(),
        messages=branch_out(messages, head),
        active_run_id=active.id if active else None,
        pending_approvals=[approval_item(a) for a in pending],
        pending_tool_calls=[tool_call_item(c) for c in calls],
    )


@router.delete(
    "/api/conversations/{conversation_id}", status_code=status.HTTP_204_NO_CONTENT, responses=ERRORS
)
async def delete_conversation(conversation_id: IdPath, services: ServicesDep, owner: OwnerDep) -> Response:
    conv = await owned_conversation(services, owner, conversation_id)
    active = await services.runs.active(conv.id)
    if active is not None:
        with contextlib.suppress(NoActiveRunError):  # it ended by itself meanwhile
            await services.manager.cancel(conv)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if await services.runs.active(conv.id) is None:
                break
            await asyncio.sleep(0.05)
    await services.conversations.delete(owner, conv.id)
    try:
        await services.bus.delete(conv.id)
    except Exception:  # the database is the record; an unreachable bus expires the stream by itself
        pass
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/api/conversations/{conversation_id}/runs",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=RunStarted,
    responses=error_responses(400, 401, 404, 409, 413, 422, 429, 503),
)
async def start_run(
    conversation_id: IdPath, body: RunCreate, services: ServicesDep, owner: OwnerDep
) -> RunStarted:
    conv = await owned_conversation(services, owner, conversation_id)
    if await services.runs.active(conv.id) is not None and (
        body.regenerate is not None or "parent_id" in body.model_fields_set
    ):
        # B-07: the branch the active run writes to is the current one until it ends.
        raise RunActiveConflict("a run is already active in this conversation")
    question = await question_of(
        services.conversations,
        services.runs,
        conv,
        message=body.message,
        parent_id=body.parent_id,
        parent_given="parent_id" in body.model_fields_set,
        regenerate=body.regenerate,
    )
    if body.webhook is not None:
        await checked_webhook(services, body.webhook)
    run = await services.manager.start_run(
        conv, question.text, placement=question.placement, webhook=body.webhook
    )
    return RunStarted(
        run_id=run.id,
        conversation_id=conv.id,
        status="queued" if run.status == "queued" else "running",
        stream_url=stream_url(conv.id),
    )


async def checked_webhook(services: Services, url: str) -> None:
    """422 unless the service posts to ``url`` (FACES.md N-06: checked again at each delivery)."""
    try:
        await services.webhooks.policy.check(url)
    except WebhookRefusedError as exc:
        raise InvalidInputError(f"webhook: {exc}") from None


@router.post(
    "/api/conversations/{conversation_id}/interrupt",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=Queued,
    responses=error_responses(400, 401, 404, 409, 413, 422, 429),
)
async def interrupt(
    conversation_id: IdPath, body: InterruptCreate, services: ServicesDep, owner: OwnerDep
) -> Queued:
    conv = await owned_conversation(services, owner, conversation_id)
    return Queued(queued=await services.manager.interrupt(conv, body.content))


@router.post(
    "/api/conversations/{conversation_id}/cancel",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=Accepted,
    responses=error_responses(401, 404, 409),
)
async def cancel(conversation_id: IdPath, services: ServicesDep, owner: OwnerDep) -> Accepted:
    conv = await owned_conversation(services, owner, conversation_id)
    run = await services.manager.cancel(conv)
    return Accepted(run_id=run.id, status="cancelling")
