"""Approvals: a person decides a tool call that waits (RUNS.md A-03, A-05), from any worker."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from app.api.deps import OwnerDep, ServicesDep
from app.api.routes.conversations import BODY_ERRORS, IdPath, owned_conversation
from app.api.schemas import ApprovalDecisionIn, ApprovalDecisionOut, ApprovalPage, error_responses
from app.api.settle import decide_approval, edited_args
from app.errors import InvalidInputError, NotFoundError
from app.runs.approvals import APPROVAL_ID, approval_item

router = APIRouter(tags=["approvals"])


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
        args = edited_args(services, approval, body.tool_args)
    decided = await decide_approval(
        services, approval, status=status, reason=body.reason, args=args, decided_by=owner
    )
    return ApprovalDecisionOut(approval_id=decided.id, status=status, run_id=decided.run_id)


@router.get("/api/approvals", response_model=ApprovalPage, responses=error_responses(401, 422))
async def list_approvals(
    services: ServicesDep,
    owner: OwnerDep,
    status: Annotated[Literal["pending"], Query()] = "pending",
) -> ApprovalPage:
    """The caller's pending approvals across conversations, oldest first (A-05)."""
    return ApprovalPage(items=[approval_item(a) for a in await services.approvals.pending(owner=owner)])
