"""Results of the tools the client runs (FACES.md C-03), from any worker."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter

from app.api.deps import OwnerDep, ServicesDep
from app.api.routes.conversations import BODY_ERRORS, IdPath, owned_conversation
from app.api.schemas import ToolResultIn, ToolResultOut, error_responses
from app.db.repositories.approvals import ApprovalClosedError
from app.errors import CallClosedConflict, InvalidInputError, NotFoundError

router = APIRouter(tags=["tool results"])
log = logging.getLogger("app.api")
MAX_OUTPUT_BYTES = 256 * 1024


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
    answered_with_error = "error" in body.model_fields_set
    output: dict[str, Any] = {"error": body.error} if answered_with_error else {"output": body.output}
    try:
        size = len(orjson.dumps(output))
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise InvalidInputError(f"output cannot be stored: {exc}") from None
    if size > MAX_OUTPUT_BYTES:
        raise InvalidInputError(f"the result is larger than {MAX_OUTPUT_BYTES} bytes")
    try:
        answered, goes_on = await services.approvals.answer(call, output)
    except ApprovalClosedError as exc:
        raise CallClosedConflict(f"call {call_id} is {exc.status}: the first result stands") from exc
    if goes_on:
        # Nothing of the run waits any more: whichever worker's claim loop is first carries it on.
        try:
            await services.manager.released_signal.request(answered.run_id, answered.conversation_id)
        except Exception as exc:
            log.warning("could not announce the run that goes on", extra={"error": repr(exc)})
    return ToolResultOut(call_id=answered.call_id, status="answered", run_id=answered.run_id)
