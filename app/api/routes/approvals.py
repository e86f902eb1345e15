"""Approvals: a person decides a tool call that waits (RUNS.md A-03, A-05), from any worker."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query

from app.api.deps import OwnerDep, ServicesDep
from app.api.routes.conversations import BODY_ERRORS, IdPath, owned_conversation
from app.api.schemas import ApprovalDecisionIn, ApprovalDecisionOut, ApprovalPage, error_responses
from app.db.repositories.approvals import ApprovalClosedError
from app.errors import ApprovalClosedConflict, InvalidInputError, NotFoundError
from app.runs.approvals import APPROVAL_ID, approval_item
from app.tools.schema_check import argument_errors

router = APIRouter(tags=["approvals"])
MAX_TOOL_ARGS_BYTES = 64 * 1024
audit_log = logging.getLogger("app.audit")
log = logging.getLogger("app.api")


@router.post(
    "/api/conversations/{conversation_id}/approvals/{approval_id}",
    response_model=ApprovalDecisionOut,
    responses={**BODY_ERRORS, **error_responses(404, 409)},
)
async def decide(
    conversation_id: IdPath,
    approval_id: str,
    body: ApprovalDecisionIn,
    services: ServicesDep,
    owner: OwnerDep,
) -> ApprovalDecisionOut:
    conv = await owned_conversation(services, owner, conversation_id)
    repo = services.approvals
    approval = await repo.get(approval_id) if APPROVAL_ID.fullmatch(approval_id) else None
    if approval is None or approval.conversation_id != conv.id:
        raise NotFoundError("approval not found")
    status: Literal["approved", "denied"] = "approved" if body.decision == "approve" else "denied"
    args: dict[str, Any] = dict(approval.tool_args)
    if body.tool_args is not None:
        if status != "approved":
            raise InvalidInputError("tool_args go with an approval only; a denial runs nothing")
        try:
            # What runs must be storable as it is sent on: JSON that nests and weighs reasonably.
            encoded = orjson.dumps(body.tool_args)
        except (orjson.JSONEncodeError, TypeError) as exc:
            raise InvalidInputError(f"tool_args cannot be used: {exc}") from None
        if len(encoded) > MAX_TOOL_ARGS_BYTES:
            raise InvalidInputError(f"tool_args are larger than {MAX_TOOL_ARGS_BYTES} bytes")
        tool = services.tools.get(approval.tool_name)
        problems = argument_errors(tool.parameters, body.tool_args) if tool is not None else []
        if problems:
            raise InvalidInputError(f"tool_args do not fit {approval.tool_name}'s parameters: {problems[0]}")
        args = dict(body.tool_args)
    try:
        decided, goes_on = await repo.decide(
            approval, status=status, reason=body.reason, decided_args=args, decided_by=owner
        )
    except ApprovalClosedError as exc:
        message = f"approval {approval.id} is {exc.status}: the first decision stands"
        raise ApprovalClosedConflict(message) from exc
    services.metrics.approvals_decided.labels(status).inc()
    audit_log.info(
        "approval decided",
        extra={
            "approval_id": decided.id,
            "run_id": decided.run_id,
            "conversation_id": decided.conversation_id,
            "tool": decided.tool_name,
            "decision": status,
            "decided_by": owner,
            "decided_at": decided.decided_at.isoformat() if decided.decided_at else None,
            "reason": body.reason,
            "args_before": approval.tool_args,
            "args_after": args,
        },
    )
    if goes_on:
        # Every decision of the run is in: whichever worker's claim loop is first carries it on.
        try:
            await services.manager.released_signal.request(decided.run_id, decided.conversation_id)
        except Exception as exc:
            log.warning("could not announce the run that goes on", extra={"error": repr(exc)})
    return ApprovalDecisionOut(approval_id=decided.id, status=status, run_id=decided.run_id)


@router.get("/api/approvals", response_model=ApprovalPage, responses=error_responses(401, 422))
async def list_approvals(
    services: ServicesDep,
    owner: OwnerDep,
    status: Annotated[Literal["pending"], Query()] = "pending",
) -> ApprovalPage:
    """The caller's pending approvals across conversations, oldest first (A-05)."""
    return ApprovalPage(items=[approval_item(a) for a in await services.approvals.pending(owner=owner)])
