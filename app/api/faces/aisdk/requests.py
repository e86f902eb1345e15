"""What a ``useChat`` request means (FACES.md V-01..V-03).

``DefaultChatTransport`` sends ``{id, messages, trigger, messageId?}`` (and what the app adds,
such as ``agent``); every message is ``{id, role, parts, metadata?}``. The client adds fields and
part types every release: unknown ones are ignored, never refused. What counts is decided from the
database alone: the chat's conversation, the messages it has (by the ids the client gave them), and
the approvals and client calls its waiting run holds as pending. An approval or a tool output in
the client's history that the database does not hold as pending for that run is never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.api.routes.conversations import checked_agent
from app.api.routes.stream import title_from
from app.api.schemas import MAX_MESSAGE_CHARS, AgentSpec, no_nul
from app.api.settle import answer_call, call_output, decide_approval
from app.container import Services
from app.db.repositories import ConversationRecord, MessageRecord, RunRecord
from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.run_start import UNDER_HEAD, Placement
from app.errors import (
    ApprovalClosedConflict,
    CallClosedConflict,
    InvalidInputError,
    NotFoundError,
)
from app.llm.base import ChatMessage

FACE = "ai-sdk"
LOOSE = ConfigDict(extra="allow")
MAX_REASON_CHARS = 2000


def _refuse_nul(value: str) -> str:
    """Text checked after validation: NUL is refused everywhere (422, not a database error)."""
    if "\x00" in value:
        raise InvalidInputError("text must not contain NUL characters")
    return value


ClientId = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(no_nul)]


class UIMessageIn(BaseModel):
    model_config = LOOSE

    id: ClientId
    role: str
    parts: list[dict[str, Any]] = Field(default_factory=list, max_length=10_000)

    def text(self) -> str:
        """The message's text parts, joined (other part types are not stored)."""
        texts = [p.get("text") for p in self.parts if p.get("type") == "text"]
        return "\n\n".join(t for t in texts if isinstance(t, str) and t)


class ChatIn(BaseModel):
    """``DefaultChatTransport``'s body; ``agent`` configures a chat's conversation when it is made."""

    model_config = LOOSE

    id: ClientId
    messages: list[UIMessageIn] = Field(min_length=1, max_length=10_000)
    trigger: Literal["submit-message", "regenerate-message"] = "submit-message"
    messageId: ClientId | None = None
    agent: AgentSpec | None = None


@dataclass(frozen=True, slots=True)
class NewRun:
    """The request starts a run: ``text`` at ``placement``."""

    text: str
    placement: Placement = UNDER_HEAD


@dataclass(frozen=True, slots=True)
class GoesOn:
    """The request settles what ``run`` waits for: its response continues the same message."""

    run: RunRecord
    settled: frozenset[str]
    """The approval ids and call ids it settled."""


async def chat_of(services: Services, owner: str, body: ChatIn) -> tuple[ConversationRecord, bool]:
    """The chat's conversation, created at first use with the text of the messages before the
    last one as its history (V-02); and whether this request created it. A request a new chat
    cannot take creates nothing."""
    found = await services.threads.find(owner, FACE, body.id)
    if found is not None:
        return found, False
    last = body.messages[-1]
    if body.trigger == "regenerate-message" or last.role == "assistant":
        raise NotFoundError("this chat has no message to answer again or to continue")
    _question_text(last)
    agent = checked_agent(services, body.agent)
    earlier = [
        (ChatMessage(role=m.role, content=m.text()), m.id)  # type: ignore[arg-type]
        for m in body.messages[:-1]
        if m.role in ("user", "assistant") and m.text()
    ]
    title = next((m.text() for m in body.messages if m.role == "user" and m.text()), "Chat")
    return await services.threads.open(
        owner, FACE, body.id, title=title_from(title), agent_config=agent, history=earlier
    )


def _by_client_id(records: list[MessageRecord], client_id: str, head_path: set[int]) -> MessageRecord | None:
    """The message the client gave ``client_id`` (on the current branch first, else the newest)."""
    found = [r for r in records if r.client_id == client_id]
    on_branch = [r for r in found if r.seq in head_path]
    candidates = on_branch or found
    return candidates[-1] if candidates else None


async def meaning(services: Services, owner: str, conv: ConversationRecord, body: ChatIn) -> NewRun | GoesOn:
    """What the request asks of the chat (V-03)."""
    last = body.messages[-1]
    if body.trigger == "submit-message" and last.role == "assistant":
        if body.messageId is not None and body.messageId != last.id:
            raise InvalidInputError("messageId names another message than the last one")
        return await _continuation(services, owner, conv, last)
    records, head = await services.conversations.branch(conv.id)
    path = _path_seqs(records, head)
    if body.trigger == "regenerate-message":
        return await _regenerate(services, owner, conv, body, records, path)
    text = _question_text(last)
    known = _by_client_id(records, last.id, path)
    if known is None:
        return NewRun(text, Placement(client_id=last.id))
    if (known.content or "") == text:
        return NewRun(known.content or "", Placement(question_seq=known.seq))
    # The same message with other text: an edit (B-02), a sibling of the message it replaces.
    return NewRun(text, Placement(under_head=False, parent_seq=known.parent_seq, client_id=last.id))


def _question_text(last: UIMessageIn) -> str:
    if last.role != "user":
        raise InvalidInputError(
            "the last message must be the user's new message, or the assistant's to continue"
        )
    text = last.text()
    if not text.strip():
        raise InvalidInputError("the last user message has no text")
    if len(text) > MAX_MESSAGE_CHARS:
        raise InvalidInputError(f"the question is longer than {MAX_MESSAGE_CHARS} characters")
    return _refuse_nul(text)


def _path_seqs(records: list[MessageRecord], head: int | None) -> set[int]:
    by_seq = {r.seq: r for r in records}
    seqs: set[int] = set()
    seq = head
    while seq is not None and seq in by_seq and seq not in seqs:
        seqs.add(seq)
        seq = by_seq[seq].parent_seq
    return seqs


async def _regenerate(
    services: Services,
    owner: str,
    conv: ConversationRecord,
    body: ChatIn,
    records: list[MessageRecord],
    path: set[int],
) -> NewRun:
    """``regenerate()`` answers a question again (B-03): the one of the message it names (a run's
    assistant message, or a user message), else the last user message the client sent."""
    target = body.messageId
    if target is not None:
        run = await services.runs.get(owner, target)
        if run is not None and run.conversation_id == conv.id and run.question_seq is not None:
            return _answer_again(records, run.question_seq)
        question = _by_client_id(records, target, path)
        if question is None or question.role != "user":
            raise NotFoundError("no message of this chat has that messageId")
        return _answer_again(records, question.seq)
    for message in reversed(body.messages):
        if message.role == "user":
            question = _by_client_id(records, message.id, path)
            if question is not None:
                return _answer_again(records, question.seq)
            break
    raise NotFoundError("this chat has no question to answer again")


def _answer_again(records: list[MessageRecord], seq: int) -> NewRun:
    question = next(r for r in records if r.seq == seq)
    if not (question.content or "").strip():
        raise InvalidInputError("that user message has no text to answer")
    return NewRun(question.content or "", Placement(question_seq=seq))


@dataclass(frozen=True, slots=True)
class _Decision:
    approval: ApprovalRecord
    approved: bool
    reason: str | None


@dataclass(frozen=True, slots=True)
class _Result:
    call: ApprovalRecord
    output: dict[str, Any]


async def _continuation(
    services: Services, owner: str, conv: ConversationRecord, last: UIMessageIn
) -> GoesOn:
    """The assistant message of a waiting run comes back with decisions and tool outputs (V-03):
    those that match what the run holds as pending settle it; nothing else is read. Everything is
    checked before anything is stored: a request refused stores nothing."""
    run = await services.runs.get(owner, last.id)
    if run is None or run.conversation_id != conv.id:
        raise NotFoundError("no run of this chat has that message id")
    asked, called = await services.approvals.waiting_of(run.id)
    approvals = {a.id: a for a in asked}
    calls = {c.call_id: c for c in called}
    plan = [step for part in last.parts if (step := _planned(part, approvals, calls)) is not None]
    settled: set[str] = set()
    for step in plan:
        try:
            if isinstance(step, _Decision):
                status: Literal["approved", "denied"] = "approved" if step.approved else "denied"
                record = step.approval
                await decide_approval(
                    services,
                    record,
                    status=status,
                    reason=step.reason,
                    args=record.tool_args,
                    decided_by=owner,
                )
                settled.add(record.id)
            else:
                record = step.call
                await answer_call(services, record, step.output)
            settled.add(record.call_id)
        except (ApprovalClosedConflict, CallClosedConflict):
            pass  # decided or answered by someone else meanwhile: the first one stands
    if not settled:
        # Answered with no progress, useChat would send the same request again at once, in a loop.
        raise CallClosedConflict(
            "nothing in that message settles what the run waits for: it was decided, answered, "
            "timed out or closed before"
        )
    return GoesOn(run, frozenset(settled))


def _planned(
    part: dict[str, Any], approvals: dict[str, ApprovalRecord], calls: dict[str, ApprovalRecord]
) -> _Decision | _Result | None:
    """What a part of the message settles, if the run holds it as pending; 422 if it cannot be
    used (an output that cannot be stored, a reason too long)."""
    state = part.get("state")
    approval = part.get("approval")
    if state in ("approval-responded", "output-denied") and isinstance(approval, dict):
        pending = approvals.get(str(approval.get("id")))
        approved = approval.get("approved")
        if pending is None or pending.call_id != part.get("toolCallId") or not isinstance(approved, bool):
            return None
        reason = approval.get("reason")
        if isinstance(reason, str) and len(reason) > MAX_REASON_CHARS:
            raise InvalidInputError(f"an approval's reason is longer than {MAX_REASON_CHARS} characters")
        return _Decision(
            pending, approved, _refuse_nul(reason) if isinstance(reason, str) and reason else None
        )
    if state in ("output-available", "output-error"):
        call = calls.get(str(part.get("toolCallId")))
        if call is None:
            return None
        if state == "output-error":
            return _Result(
                call, call_output(error=_refuse_nul(str(part.get("errorText") or "the tool failed")))
            )
        return _Result(call, call_output(part.get("output")))
    return None
