"""Results of the tools the client runs (FACES.md C-03), from any worker."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import OwnerDep, ServicesDep
from app.api.routes.conversations import BODY_ERRORS, IdPath, owned_conversation
from app.api.schemas import ToolResultIn, ToolResultOut, error_responses
from app.api.settle import answer_call, call_output
from app.errors import NotFoundError

router = APIRouter(tags=["tool results"])


@router.post(
    "/api/conversations/{conversation_id}/tool-results/{call_id}",
    response_model=ToolResultOut,
    responses={**BODY_ERRORS, **error_responses(404, 409)},
)
async def tool_result(
    conversation_id: IdPath, call_id: str, body: ToolResultIn, services: ServicesDep, owner: OwnerDep
) -> ToolResultOut:
    conv = await owned_conversation(services, owner, conversation_id)
    # An id no call can have (too long, or with a NUL, which PostgreSQL refuses in a query) is
    # unknown, not a database error.
    usable = len(call_id) <= 200 and "\x00" not in call_id
    call = await services.approvals.client_call(conv.id, call_id) if usable else None
    if call is None:
        raise NotFoundError("no call of a tool the client runs has that id in this conversation")
    if "error" in body.model_fields_set:
        output = call_output(error=body.error)
    else:
        output = call_output(body.output)
    answered = await answer_call(services, call, output)
    return ToolResultOut(call_id=answered.call_id, status="answered", run_id=answered.run_id)
