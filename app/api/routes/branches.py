"""A conversation's branches: switch (FACES.md B-04), fork (B-05), replay a run from a checkpoint
(B-06). Edit and regenerate are ``POST .../runs`` (``app.api.routes.conversations``)."""

from __future__ import annotations

from fastapi import APIRouter, status

from app.api.deps import OwnerDep, ServicesDep
from app.api.presenters import conversation_out
from app.api.routes.conversations import (
    BODY_ERRORS,
    IdPath,
    conversation_detail,
    owned_conversation,
    stream_url,
)
from app.api.routes.runs import owned_run
from app.api.schemas import (
    ConversationDetail,
    ConversationOut,
    ForkIn,
    HeadIn,
    ReplayIn,
    RunStarted,
    error_responses,
)
from app.db.errors import RunActiveError
from app.db.repositories.run_start import Placement
from app.errors import InvalidInputError, NotFoundError, RunActiveConflict
from app.runs import replay
from app.runs.branches import check_parent, find_message

router = APIRouter(tags=["branches"])
_ACTIVE = "a run is active in this conversation: its branch is the current one until it ends"


@router.put(
    "/api/conversations/{conversation_id}/head",
    response_model=ConversationDetail,
    responses={**BODY_ERRORS, **error_responses(404, 409)},
)
async def switch(
    conversation_id: IdPath, body: HeadIn, services: ServicesDep, owner: OwnerDep
) -> ConversationDetail:
    """Make the newest leaf below ``message_id`` the current leaf (B-04)."""
    conv = await owned_conversation(services, owner, conversation_id)
    target = find_message(await services.conversations.messages(conv.id), body.message_id)
    try:
        await services.conversations.switch(conv.id, target.seq)
    except RunActiveError as exc:
        raise RunActiveConflict(_ACTIVE) from exc
    return await conversation_detail(services, conv)


@router.post(
    "/api/conversations/{conversation_id}/fork",
    status_code=status.HTTP_201_CREATED,
    response_model=ConversationOut,
    responses={**BODY_ERRORS, **error_responses(404, 409)},
)
async def fork(
    conversation_id: IdPath, body: ForkIn, services: ServicesDep, owner: OwnerDep
) -> ConversationOut:
    """A new conversation whose messages are the path to ``message_id`` (B-05)."""
    conv = await owned_conversation(services, owner, conversation_id)
    records = await services.conversations.messages(conv.id)
    target = find_message(records, body.message_id)
    # The fork's next question follows that message: a provider refuses a history whose tool
    # calls have no results after them.
    check_parent(records, target, "message_id")
    if await services.runs.active(conv.id) is not None:
        raise RunActiveConflict(_ACTIVE)
    forked = await services.conversations.fork(conv, target.seq, body.title or f"{conv.title} (fork)"[:200])
    return conversation_out(forked)


@router.post(
    "/api/runs/{run_id}/replay",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=RunStarted,
    responses={**BODY_ERRORS, **error_responses(404, 409, 429, 503)},
)
async def replay_run(run_id: str, body: ReplayIn, services: ServicesDep, owner: OwnerDep) -> RunStarted:
    """A new run answering the same question, from the run's last checkpoint at or before the
    event ``after`` (B-06): the tool results checkpointed before it are reused, not run again."""
    source = await owned_run(services, owner, run_id)
    conv = await owned_conversation(services, owner, source.conversation_id)
    events = await services.events.for_run(source.id)
    after = body.after
    chosen = next((event for event in events if event.id == after), None)
    if chosen is None:
        raise NotFoundError("no event of this run has that id")
    # A step a replay restated: its checkpoints are the source's, from there on.
    while source.replay_of is not None and (earlier := replay.restated_from(chosen)) is not None:
        origin = await services.runs.get(owner, source.replay_of)
        origin_events = await services.events.for_run(origin.id) if origin is not None else []
        found = next((event for event in origin_events if event.id == earlier), None)
        if origin is None or found is None:
            break  # the source is gone: the replay goes from what this run holds
        source, events, after, chosen = origin, origin_events, earlier, found
    if body.model is not None and body.model not in services.models:
        raise InvalidInputError(f"unknown model {body.model!r}; see GET /api/models")
    if source.question_seq is None:
        raise InvalidInputError("this run has no question stored to answer again")
    if await services.runs.active(conv.id) is not None:
        raise RunActiveConflict(_ACTIVE)
    start = replay.plan(source.id, after, events, await services.runs.all_checkpoints(source.id), body.model)
    if not start.state.empty and _mode(services, conv.agent_config, body.model) != _mode(
        services, conv.agent_config, source.model
    ):
        raise InvalidInputError(
            "that model speaks to tools another way (JSON mode, native function calling) than the "
            "run's: its checkpoints cannot be carried on there; replay from before the first step, "
            "or on a model of the same mode"
        )
    run = await services.manager.start_run(
        conv,
        source.message,
        placement=Placement(question_seq=source.question_seq),
        client_tools=source.client_tools,
        replay=start,
    )
    return RunStarted(
        run_id=run.id,
        conversation_id=conv.id,
        status="queued" if run.status == "queued" else "running",
        stream_url=stream_url(conv.id),
    )


def _mode(services: ServicesDep, agent: dict[str, object], model: str | None) -> str:
    """Whether runs of the conversation on ``model`` use native function calling (E-07)."""
    if (agent or {}).get("mode") == "json":
        return "json"
    chosen = model if model is not None else agent.get("model")
    name = services.models.resolve(chosen if isinstance(chosen, str) else None)
    return "native" if services.models.llm(name).abilities.get("tool_call", False) else "json"
