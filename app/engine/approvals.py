"""Tool calls that wait for a person (RUNS.md A-01..A-04), as the engine sees them.

The engine knows no HTTP, database or clock of approvals: a PreToolUse hook (``RequireApproval``,
or any hook of the caller's) answers a call with ``ask``; the loop then asks the run's
``Approvals`` for a ticket (the approval's id and expiry), announces the request, records the call
as awaiting in its checkpoints and stops at the end of the reply's other calls. The caller parks the
run. When every decision is in, a new attempt of the run gets them from ``Approvals.decision`` and
the loop carries on: an approved call runs (with the person's arguments, when edited), a denied or
expired one becomes an observation that says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from app.engine.hooks import PreToolDecision, ToolCallContext

DecisionStatus = Literal["approved", "denied", "expired", "answered"]
"""``answered``: the client sent the result of a tool it runs (FACES.md C-03)."""


@dataclass(frozen=True, slots=True)
class ApprovalTicket:
    approval_id: str
    expires_at: str
    """ISO 8601, UTC."""


@dataclass(frozen=True, slots=True)
class ApprovalDecision:
    approval_id: str
    status: DecisionStatus
    reason: str | None = None
    tool_args: Mapping[str, Any] | None = None
    """The arguments that run (approved): the person's edit, or None for the call's own."""
    output: str | None = None
    """``answered``: the client's result as the model reads it."""
    error: str | None = None
    """``answered``: the error the client reported instead of a result."""


class Approvals(Protocol):
    """A run's approvals, as its caller keeps them."""

    def ticket(
        self,
        call_id: str,
        tool_name: str,
        tool_args: Mapping[str, Any],
        iteration: int,
        *,
        client: bool = False,
    ) -> ApprovalTicket:
        """The approval a call that waits for a person gets (the same for the same call); with
        ``client``, the record of a call that waits for the client's result (C-02)."""
        ...

    def decision(self, call_id: str) -> ApprovalDecision | None:
        """The decision taken on the call's approval, or None while it is pending."""
        ...


class RequireApproval:
    """PreToolUse hook: calls of the named tools (``"*"``: every tool) wait for a person (A-01)."""

    def __init__(self, tools: Iterable[str]) -> None:
        names = frozenset(tools)
        self._every = "*" in names
        self._names = names - {"*"}

    def __bool__(self) -> bool:
        return self._every or bool(self._names)

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        if ctx.tool is None or ctx.tool.client:
            # An unknown tool runs nowhere, and a tool the client runs is in the user's hands
            # already (its application answers for it): nothing to approve here.
            return None
        if self._every or ctx.tool_name in self._names:
            return PreToolDecision(ask=True, reason=f"Calls of `{ctx.tool_name}` need a person's approval.")
        return None


__all__ = ["ApprovalDecision", "ApprovalTicket", "Approvals", "DecisionStatus", "RequireApproval"]
