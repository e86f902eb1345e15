"""What the tool loop makes of an LLM reply and of each of its calls (shared by both modes).

``ParsedReply`` is a reply as a strategy read it, ``CallOutcome`` how one call ended; the calls'
ids are made unique within the run (``with_unique_ids``: they are idempotency keys, RUNS.md R-05),
and the result of a tool the client ran becomes an outcome like any other (``client_outcome``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.engine import prompts
from app.engine.approvals import ApprovalDecision
from app.engine.state import PlannedCall, ReplyKind
from app.llm.base import ChatMessage
from app.tools.registry import ToolResult


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """One LLM reply, read by a strategy.

    ``tools``: run ``calls``. ``final``: the model is done, ``answer`` is its answer. ``unparsed``
    (JSON mode only, E-08): ``answer`` holds the raw content.
    """

    kind: ReplyKind
    reasoning: str
    assistant: ChatMessage
    calls: tuple[PlannedCall, ...] = ()
    answer: str = ""


@dataclass(frozen=True, slots=True)
class CallOutcome:
    call: PlannedCall
    observation: str
    """Exactly what the LLM sees."""
    error: str | None
    ran: bool
    """The tool really executed (not blocked, arguments usable, tool exists): a "real" tool call."""
    counted: bool = True
    """The cycle detector counts it: not a call a person refused (or let expire)."""


def with_unique_ids(parsed: ParsedReply, taken: set[str], iteration: int, mark: str = "") -> ParsedReply:
    """``parsed`` with every call id unique within the run (``taken``: the run's ids so far, which
    the new ones join; a provider may send none, or ``call_0`` on every reply). Ids made here carry
    ``mark`` (a piece of the run's id): a client answers a call by its id within a conversation."""
    if not parsed.calls:
        return parsed
    calls: list[PlannedCall] = []
    renamed = False
    for index, call in enumerate(parsed.calls):
        call_id = call.call_id
        if not call_id or call_id in taken:
            call_id = f"call_{mark}{iteration}_{index}"
            while call_id in taken:
                call_id += "x"
            call = replace(call, call_id=call_id)
            renamed = True
        taken.add(call_id)
        calls.append(call)
    if not renamed:
        return parsed
    assistant = parsed.assistant
    if len(assistant.tool_calls) == len(calls):
        assistant = replace(
            assistant,
            tool_calls=tuple(
                replace(tc, id=call.call_id) for tc, call in zip(assistant.tool_calls, calls, strict=True)
            ),
        )
    return replace(parsed, calls=tuple(calls), assistant=assistant)


def client_outcome(call: PlannedCall, decision: ApprovalDecision) -> tuple[CallOutcome, ToolResult]:
    """A call of a tool the client runs, as its result came back, or as nothing did in time (C-03)."""
    if decision.status == "answered" and decision.error is None:
        output = decision.output or ""
        observation = output if output.strip() else "(the tool returned no output)"
        return CallOutcome(call, observation, None, ran=True), ToolResult(content=output)
    if decision.status == "answered":
        error = str(decision.error)
        return CallOutcome(call, f"Error: {error}", error, ran=True), ToolResult(content="", error=error)
    error = prompts.client_call_expired(call.tool_name)
    return CallOutcome(call, error, error, ran=False, counted=False), ToolResult(content="", error=error)
