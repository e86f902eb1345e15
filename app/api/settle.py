"""Settling what a run waits for (RUNS.md A-03, FACES.md C-03): a person's decision on an approval,
a client's result of a tool it runs. The own API's routes and every protocol face come here, so a
decision or a result counts the same whichever way it came, from any worker."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Literal

from app.container import Services
from app.db.repositories.approvals import ApprovalClosedError, ApprovalRecord
from app.errors import ApprovalClosedConflict, CallClosedConflict, InvalidInputError
from app.tools.schema_check import argument_errors

MAX_TOOL_ARGS_BYTES = 64 * 1024
MAX_OUTPUT_BYTES = 256 * 1024
audit_log = logging.getLogger("app.audit")
log = logging.getLogger("app.api")


def _compact_json(value: Any) -> bytes:
    """``value`` as the database's JSON takes it: NaN and Infinity refused (ValueError)."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode()


def edited_args(services: Services, approval: ApprovalRecord, tool_args: Any) -> dict[str, Any]:
    """Arguments a person edited for an approved call, checked against the tool's parameters."""
    try:
        # What runs must be storable as it is sent on: JSON (finite numbers) that nests and
        # weighs reasonably.
        encoded = _compact_json(tool_args)
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidInputError(f"tool_args cannot be used: {exc}") from None
    if len(encoded) > MAX_TOOL_ARGS_BYTES:
        raise InvalidInputError(f"tool_args are larger than {MAX_TOOL_ARGS_BYTES} bytes")
    if not isinstance(tool_args, dict):
        raise InvalidInputError("tool_args must be a JSON object")
    tool = services.tools.get(approval.tool_name)
    problems = argument_errors(tool.parameters, tool_args) if tool is not None else []
    if problems:
        raise InvalidInputError(f"tool_args do not fit {approval.tool_name}'s parameters: {problems[0]}")
    return dict(tool_args)


async def decide_approval(
    services: Services,
    approval: ApprovalRecord,
    *,
    status: Literal["approved", "denied"],
    reason: str | None,
    args: Mapping[str, Any],
    decided_by: str,
) -> ApprovalRecord:
    """Store a person's decision and carry the run on once nothing of it waits; 409
    ``approval_closed`` when it was decided, expired or closed before (the first decision stands)."""
    try:
        decided, goes_on = await services.approvals.decide(
            approval, status=status, reason=reason, decided_args=args, decided_by=decided_by
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
            "decided_by": decided_by,
            "decided_at": decided.decided_at.isoformat() if decided.decided_at else None,
            "reason": reason,
            "args_before": approval.tool_args,
            "args_after": dict(args),
        },
    )
    if goes_on:
        await _go_on(services, decided)
    return decided


def call_output(output: Any = None, *, error: str | None = None, **extra: Any) -> dict[str, Any]:
    """A client call's result as stored: ``{"output": any}`` or ``{"error": str}`` (plus what a
    face keeps beside it, such as the client's id of its tool message); 422 if it cannot be."""
    stored: dict[str, Any] = {"error": error} if error is not None else {"output": output}
    stored.update(extra)
    try:
        # What the database's JSON takes: no NaN or Infinity (orjson would write them as null).
        size = len(_compact_json(stored))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidInputError(f"output cannot be stored: {exc}") from None
    if size > MAX_OUTPUT_BYTES:
        raise InvalidInputError(f"the result is larger than {MAX_OUTPUT_BYTES} bytes")
    return stored


async def answer_call(services: Services, call: ApprovalRecord, output: Mapping[str, Any]) -> ApprovalRecord:
    """Store a client call's result (``call_output``) and carry the run on once nothing of it
    waits; 409 ``call_closed`` when it was answered, timed out or closed (the first result stands)."""
    try:
        answered, goes_on = await services.approvals.answer(call, output)
    except ApprovalClosedError as exc:
        raise CallClosedConflict(f"call {call.call_id} is {exc.status}: the first result stands") from exc
    if goes_on:
        await _go_on(services, answered)
    return answered


async def _go_on(services: Services, settled: ApprovalRecord) -> None:
    """Nothing of the run waits any more: whichever worker's claim loop is first carries it on."""
    try:
        await services.manager.released_signal.request(settled.run_id, settled.conversation_id)
    except Exception as exc:
        log.warning("could not announce the run that goes on", extra={"error": repr(exc)})
