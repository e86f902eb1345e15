"""Runs that wait for a person (RUNS.md A-01..A-06), on the service's side.

The engine says which calls wait (``app.engine.approvals``); here a run's approvals get their ids
and expiry (``RunApprovals``), are stored before their ``approval`` event goes out (so a decision
made the moment the event arrives finds its approval), the run is parked (``park``: status
``waiting``, held by no worker), and a decision or an expiry that settles a run's last pending
approval hands it to whichever worker's claim loop takes it first (``ApprovalRepo``). The decision
route lives in ``app.api.routes.approvals``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import orjson

from app.db.models import utcnow
from app.db.repositories.approvals import ApprovalRecord, ApprovalRepo, NewApproval, ParkResult
from app.db.repositories.rows import ConversationRecord
from app.engine.approvals import ApprovalDecision, ApprovalTicket, RequireApproval
from app.engine.events import ApprovalRequested, IterationStarted
from app.observability import Metrics
from app.runs.closing import while_unreachable
from app.settings import Settings
from app.tools.registry import Tool, client_tool

log = logging.getLogger("app.runs")
audit_log = logging.getLogger("app.audit")


APPROVAL_ID = re.compile(r"apr_[0-9a-f]{32}")


def approval_id(
    run_id: str, call_id: str, tool_name: str, tool_args: Mapping[str, Any], *, prefix: str = "apr_"
) -> str:
    """The id of a call's approval (``tcl_``: of a client call's record): the same for every
    attempt that asks for the same call (its id, tool and arguments), never the same for another."""
    args = orjson.dumps(dict(tool_args), option=orjson.OPT_SORT_KEYS).decode()
    return prefix + hashlib.sha256(f"{run_id}\0{call_id}\0{tool_name}\0{args}".encode()).hexdigest()[:32]


def required_tools(settings: Settings, conversation: ConversationRecord) -> list[str]:
    """A-01: the conversation's own ``require_approval`` (an empty list included), else the service's."""
    own = (conversation.agent_config or {}).get("require_approval")
    return list(own) if own is not None else settings.approval_tools()


def client_tools_of(
    conversation: ConversationRecord, of_run: Sequence[Mapping[str, Any]] | None = None
) -> list[Tool]:
    """The tools the client runs that a run of ``conversation`` offers the model (FACES.md C-01):
    the conversation's ``agent.client_tools``, then the run's own (a name declared twice: the
    first)."""
    declared = [*((conversation.agent_config or {}).get("client_tools") or ()), *(of_run or ())]
    tools: dict[str, Tool] = {}
    for spec in declared:
        name = str(spec.get("name", ""))
        if name and name not in tools:
            parameters = spec.get("parameters") or {"type": "object", "properties": {}}
            tools[name] = client_tool(name, str(spec.get("description") or ""), parameters)
    return list(tools.values())


def approval_policy(settings: Settings, conversation: ConversationRecord) -> RequireApproval | None:
    policy = RequireApproval(required_tools(settings, conversation))
    return policy if policy else None


def client_observation(output: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """A client call's stored result as the model reads it: (output text, error)."""
    output = output or {}
    if "error" in output:
        return None, str(output["error"])
    value = output.get("output")
    if isinstance(value, str):
        return value, None
    return orjson.dumps(value).decode(), None


def decisions_of(records: Sequence[ApprovalRecord]) -> dict[str, ApprovalDecision]:
    """The decisions taken on a run's approvals and the results of its client calls, by call id
    (pending and cancelled ones are none)."""
    out: dict[str, ApprovalDecision] = {}
    for r in records:
        if r.status == "answered":
            text, error = client_observation(r.output)
            out[r.call_id] = ApprovalDecision(r.id, "answered", output=text, error=error)
        elif r.status in ("approved", "denied", "expired"):
            args = r.decided_args if r.status == "approved" else None
            out[r.call_id] = ApprovalDecision(r.id, r.status, r.reason, args)  # type: ignore[arg-type]
    return out


class RunApprovals:
    """The engine's ``Approvals`` for one attempt of a run: tickets made here, decisions as the
    database had them when the attempt started."""

    def __init__(
        self,
        run_id: str,
        timeout_s: float,
        decisions: Mapping[str, ApprovalDecision],
        client_timeout_s: float = 3600.0,
    ) -> None:
        self._run_id = run_id
        self._timeout = timedelta(seconds=timeout_s)
        self._client_timeout = timedelta(seconds=client_timeout_s)
        self._decisions = dict(decisions)

    def ticket(
        self,
        call_id: str,
        tool_name: str,
        tool_args: Mapping[str, Any],
        iteration: int,
        *,
        client: bool = False,
    ) -> ApprovalTicket:
        prefix, timeout = ("tcl_", self._client_timeout) if client else ("apr_", self._timeout)
        ticket_id = approval_id(self._run_id, call_id, tool_name, tool_args, prefix=prefix)
        return ApprovalTicket(ticket_id, (utcnow() + timeout).isoformat())

    def decision(self, call_id: str) -> ApprovalDecision | None:
        return self._decisions.get(call_id)


AskEvent = ApprovalRequested | IterationStarted
"""An event that asks for something the run waits for: a person's decision, a client's result."""


class ApprovalDesk:
    """What the run executor does with approvals: store a request before its event goes out, park
    a run that waits, and load a run's decisions for its next attempt."""

    def __init__(self, repo: ApprovalRepo, metrics: Metrics) -> None:
        self.repo = repo
        self.metrics = metrics

    async def store(
        self, event: AskEvent, *, run_id: str, conversation_id: str, owner: str
    ) -> AskEvent | None:
        """Store what ``event`` asks for before it goes out (so that a decision, or a client's
        result, sent the moment a client sees it finds it): an approval (A-02), or a call of a tool
        the client runs (FACES.md C-02). Returns the event as stored (an ask a previous attempt
        stored keeps its expiry), or None when it was settled already (an attempt whose record of
        the ask was lost asks again: the run parks and goes on at once, with what came)."""
        client = isinstance(event, IterationStarted)
        assert event.approval_id is not None and event.expires_at is not None and event.call_id
        new = NewApproval(
            id=event.approval_id,
            run_id=run_id,
            conversation_id=conversation_id,
            owner=owner,
            call_id=event.call_id,
            tool_name=event.tool_name,
            tool_args=event.tool_args,
            iteration=event.iteration,
            expires_at=datetime.fromisoformat(event.expires_at),
            kind="client" if client else "approval",
        )
        stored = await while_unreachable(lambda: self.repo.request(new))
        if stored.status != "pending":
            return None
        if client:
            self.metrics.client_calls.inc()
        else:
            self.metrics.approvals_requested.inc()
            audit_log.info(
                "approval requested",
                extra={
                    "approval_id": stored.id,
                    "run_id": run_id,
                    "conversation_id": conversation_id,
                    "tool": stored.tool_name,
                    "expires_at": stored.expires_at.isoformat(),
                },
            )
        expires_at = stored.expires_at.isoformat()
        return event if expires_at == event.expires_at else replace(event, expires_at=expires_at)

    async def park(self, run_id: str, attempt: int, worker_id: str) -> ParkResult:
        return await while_unreachable(lambda: self.repo.park(run_id, attempt, worker_id))

    async def decisions(self, run_id: str) -> dict[str, ApprovalDecision]:
        return decisions_of(await self.repo.of_run(run_id))

    async def expire_due(self) -> list[str]:
        """Expire what is due; returns the runs that go on because of it."""
        expired, resumed = await self.repo.expire_due()
        if expired:
            self.metrics.approvals_expired.inc(expired)
            log.info("approvals expired", extra={"expired": expired, "runs_resumed": len(resumed)})
        return resumed


def approval_item(record: ApprovalRecord) -> dict[str, Any]:
    """An approval as the API shows it (``GET /api/approvals``, ``pending_approvals``)."""
    return {
        "approval_id": record.id,
        "conversation_id": record.conversation_id,
        "run_id": record.run_id,
        "call_id": record.call_id,
        "tool_name": record.tool_name,
        "tool_args": record.tool_args,
        "status": record.status,
        "created_at": record.created_at.isoformat(),
        "expires_at": record.expires_at.isoformat(),
    }


def tool_call_item(record: ApprovalRecord) -> dict[str, Any]:
    """A client call that waits for its result, as the API shows it (``pending_tool_calls``, C-02)."""
    return {
        "call_id": record.call_id,
        "tool_name": record.tool_name,
        "tool_args": record.tool_args,
        "expires_at": record.expires_at.isoformat(),
    }
