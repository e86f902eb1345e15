"""What an AG-UI request settles of its thread's waiting run (FACES.md G-02, G-04; design note D1.5).

``resume`` entries decide the run's pending approvals (``resolved`` with ``{approved, editedArgs?,
reason?}``; ``cancelled`` is a denial), and ``tool`` messages answering its pending client calls
are their results. Only what the database holds as pending for the run counts: the client's
history is never trusted. Call ids are unique within a run only (a provider that numbers a reply's
calls from 0 repeats them across a thread's runs), so a ``tool`` message the thread holds already
answers no new call. Everything is checked before anything is decided, so a refused resume
(``Refusal``, answered as ``RUN_ERROR``) decides nothing. A ``cancelled`` entry for an interrupt of
the thread that expired or was decided already is a no-op: the 1.0 client makes a thread cancel
its expired interrupts before it runs again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from app.api.faces.agui.requests import ResumeIn, ToolMessageIn, text_of
from app.api.faces.agui.snapshot import client_results
from app.api.schemas import ApprovalDecisionIn
from app.api.settle import answer_call, call_output, decide_approval, edited_args
from app.container import Services
from app.db.repositories.approvals import ApprovalRecord
from app.errors import ApprovalClosedConflict, CallClosedConflict, InvalidInputError
from app.runs.approvals import APPROVAL_ID


class Refusal(Exception):
    """What the request asks cannot be done; the response says so in ``RUN_ERROR {code}``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Decision:
    approval: ApprovalRecord
    status: Literal["approved", "denied"]
    reason: str | None
    args: dict[str, Any]


@dataclass(slots=True)
class Settlement:
    decisions: list[Decision] = field(default_factory=list)
    results: list[tuple[ApprovalRecord, dict[str, Any]]] = field(default_factory=list)

    @property
    def ids(self) -> set[str]:
        """The approval and call ids it settles (the ``waiting`` event names them)."""
        return {d.approval.id for d in self.decisions} | {call.call_id for call, _ in self.results}

    def __bool__(self) -> bool:
        return bool(self.decisions or self.results)


async def settlement(
    services: Services,
    conversation_id: str | None,
    *,
    approvals: Sequence[ApprovalRecord],
    calls: Sequence[ApprovalRecord],
    entries: Sequence[ResumeIn],
    tool_messages: Sequence[ToolMessageIn],
    known: Collection[str] = (),
    other_runs: Collection[str] = (),
) -> Settlement:
    """What the request settles of the pending ``approvals`` and ``calls`` of the thread's run;
    ``Refusal`` (nothing decided) for a resume that misses an open interrupt, names an unknown
    one, or carries a bad payload; ``InvalidInputError`` (422) for a result that cannot be stored.

    ``known``: the ids of the thread's messages (its snapshot's, with the client's tool messages
    its runs' calls were answered with); ``other_runs``: runs whose answers are not among them."""
    out = Settlement()
    open_ = {a.id: a for a in approvals}
    answered: set[str] = set()
    for entry in entries:
        if entry.interrupt_id in answered:
            raise Refusal("invalid_resume", f"interrupt {entry.interrupt_id} is answered twice")
        answered.add(entry.interrupt_id)
        approval = open_.get(entry.interrupt_id)
        if approval is None:
            if entry.status == "cancelled" and await _closed(services, conversation_id, entry.interrupt_id):
                continue
            raise Refusal("invalid_resume", f"no open interrupt of this thread has id {entry.interrupt_id}")
        out.decisions.append(_decision(services, approval, entry))
    answers = await _answers(services, calls, tool_messages, known, other_runs)
    out.results.extend((call, _result(answers[call.call_id])) for call in calls if call.call_id in answers)
    missed = [a.id for a in approvals if a.id not in answered]
    if missed and (entries or out.results):
        raise Refusal("invalid_resume", f"the resume misses open interrupts: {', '.join(missed)}")
    return out


async def _answers(
    services: Services,
    calls: Sequence[ApprovalRecord],
    tool_messages: Sequence[ToolMessageIn],
    known: Collection[str],
    other_runs: Collection[str],
) -> dict[str, ToolMessageIn]:
    """The tool message answering each pending call, by call id: the last of those that are new
    (a message the thread holds as a result already answered an earlier call of the same id)."""
    pending = {c.call_id for c in calls}
    new = [m for m in tool_messages if m.tool_call_id in pending and m.id not in known]
    if new and other_runs:
        held = {
            result.message_id
            for run_id in sorted(other_runs)
            for result in client_results(await services.approvals.of_run(run_id)).values()
        }
        new = [m for m in new if m.id not in held]
    return {m.tool_call_id: m for m in new}  # the last one of a call stands


async def _closed(services: Services, conversation_id: str | None, interrupt_id: str) -> bool:
    """Whether ``interrupt_id`` is an approval of the thread that is no longer open."""
    if conversation_id is None or not APPROVAL_ID.fullmatch(interrupt_id):
        return False
    found = await services.approvals.get(interrupt_id)
    return found is not None and found.conversation_id == conversation_id and found.kind == "approval"


def _decision(services: Services, approval: ApprovalRecord, entry: ResumeIn) -> Decision:
    payload = entry.payload if isinstance(entry.payload, dict) else {}
    reason = payload.get("reason")
    edited = None
    approved: Any = False
    if entry.status == "cancelled":
        reason = reason if isinstance(reason, str) else None
    else:
        approved = payload.get("approved")
        if not isinstance(approved, bool):
            raise Refusal(
                "invalid_resume", f"interrupt {approval.id}: payload.approved must be true or false"
            )
        edited = payload.get("editedArgs")
    try:
        checked = ApprovalDecisionIn.model_validate(
            {"decision": "approve" if approved else "deny", "reason": reason, "tool_args": edited}
        )
        if checked.tool_args is not None and not approved:
            raise InvalidInputError("editedArgs go with an approval only; a denial runs nothing")
        args = dict(approval.tool_args)
        if checked.tool_args is not None:
            args = edited_args(services, approval, checked.tool_args)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem.get("loc", ()))
        raise Refusal("invalid_resume", f"interrupt {approval.id}: {where}: {problem.get('msg')}") from None
    except InvalidInputError as exc:
        raise Refusal("invalid_resume", f"interrupt {approval.id}: {exc.message}") from None
    return Decision(approval, "approved" if approved else "denied", checked.reason, args)


def _result(message: ToolMessageIn) -> dict[str, Any]:
    """A client call's result as stored, with the id of the client's tool message beside it (the
    snapshots show the message under that id: G-03)."""
    content = text_of(message.content)
    if message.error is not None:
        return call_output(error=message.error, message_id=message.id, content=content)
    return call_output(content, message_id=message.id)


async def settle(services: Services, plan: Settlement, owner: str) -> None:
    """Decide and answer what ``plan`` holds (whichever settles the last one carries the run on).

    What was closed since the request read it (a concurrent resume, a decision or result through
    the own API, an approval past its ``expires_at``) counts as settled by someone else: the first
    one stands, and the rest of the plan goes on. Only if nothing of it is settled here is the
    request a 409 (``approval_closed`` or ``call_closed``, the first conflict met)."""
    conflict: ApprovalClosedConflict | CallClosedConflict | None = None
    settled = False
    for d in plan.decisions:
        try:
            await decide_approval(
                services, d.approval, status=d.status, reason=d.reason, args=d.args, decided_by=owner
            )
            settled = True
        except ApprovalClosedConflict as exc:
            conflict = conflict or exc
    for call, output in plan.results:
        try:
            await answer_call(services, call, output)
            settled = True
        except CallClosedConflict as exc:
            conflict = conflict or exc
    if conflict is not None and not settled:
        raise conflict
