"""``ApprovalRepo``: tool calls that wait for a person, and the runs that wait on them (RUNS.md A-02..A-06).

A run that waits is a row (status ``waiting``, held by no worker) and its approvals are rows: no
task, lease or memory anywhere. Whatever decides the last pending approval of a waiting run (a
decision, an expiry) turns the run back into a running run that no worker holds, in the same
transaction, which any worker's claim loop then takes like a run released at a hand-over.

Every transaction that can change a run's status takes the run's row first (a no-op UPDATE), so
that a run being parked and its last decision, made at the same moment through two workers,
cannot both miss each other: whichever commits second sees the other's write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import case, exists, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import PersistenceError
from app.db.models import Approval, Run, utcnow
from app.db.repositories.push_configs import has_push_configs
from app.db.repositories.run_notices import NOTIFY, RunNotices

ParkResult = Literal["waiting", "released", "cancelled", "lost"]


class ApprovalClosedError(PersistenceError):
    """The approval was decided already, expired, or closed with its run (409 ``approval_closed``)."""

    def __init__(self, status: str) -> None:
        super().__init__(f"the approval is {status}; the first decision stands")
        self.status = status


@dataclass(frozen=True, slots=True)
class ApprovalRecord:
    id: str
    run_id: str
    conversation_id: str
    owner: str
    call_id: str
    tool_name: str
    tool_args: dict[str, Any]
    iteration: int
    status: str
    reason: str | None
    decided_args: dict[str, Any] | None
    decided_by: str | None
    created_at: datetime
    expires_at: datetime
    decided_at: datetime | None
    kind: str = "approval"
    """``approval`` (a person decides) or ``client`` (a tool the client runs; FACES.md C-02)."""
    output: dict[str, Any] | None = None
    """A client call's result: ``{"output": any}`` or ``{"error": str}``."""


@dataclass(frozen=True, slots=True)
class NewApproval:
    id: str
    run_id: str
    conversation_id: str
    owner: str
    call_id: str
    tool_name: str
    tool_args: Mapping[str, Any]
    iteration: int
    expires_at: datetime
    kind: str = "approval"


def _record(row: Any) -> ApprovalRecord:
    return ApprovalRecord(
        id=row.id,
        run_id=row.run_id,
        conversation_id=row.conversation_id,
        owner=row.owner,
        call_id=row.call_id,
        tool_name=row.tool_name,
        tool_args=dict(row.tool_args),
        iteration=row.iteration,
        status=row.status,
        reason=row.reason,
        decided_args=dict(row.decided_args) if row.decided_args is not None else None,
        decided_by=row.decided_by,
        created_at=row.created_at,
        expires_at=row.expires_at,
        decided_at=row.decided_at,
        kind=row.kind,
        output=dict(row.output) if row.output is not None else None,
    )


_PENDING_OF_RUN = exists().where(Approval.run_id == Run.id, Approval.status == "pending")
_RUN_ACTIVE = exists().where(Run.id == Approval.run_id, Run.status.in_(("running", "waiting")))
"""An approval is open only while its run is: one left pending by a run that ended (cancelled
while it was asking, failed) can no longer be decided, and is listed nowhere."""


async def _lock_run(session: AsyncSession, run_id: str) -> None:
    await session.execute(update(Run).where(Run.id == run_id).values(attempt=Run.attempt))


async def _go_on_if_decided(session: AsyncSession, run_id: str) -> bool:
    """A waiting run with no pending approval left becomes a running run that no worker holds."""
    result = await session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == "waiting", ~_PENDING_OF_RUN)
        .values(status="running", worker_id=None, lease_expires_at=None)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


class ApprovalRepo:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], notices: RunNotices | None = None
    ) -> None:
        """``notices``: told of a run that starts waiting, in the transaction that parks it, when
        the run has listeners (the webhooks' outbox); None: nobody is told."""
        self._sessionmaker = sessionmaker
        self._notices = notices

    async def request(self, new: NewApproval) -> ApprovalRecord:
        """Store a pending approval, or return the one a previous attempt stored for the same call."""
        row = {
            "id": new.id,
            "run_id": new.run_id,
            "conversation_id": new.conversation_id,
            "owner": new.owner,
            "call_id": new.call_id,
            "tool_name": new.tool_name,
            "tool_args": dict(new.tool_args),
            "iteration": new.iteration,
            "status": "pending",
            "created_at": utcnow(),
            "expires_at": new.expires_at,
            "kind": new.kind,
        }
        try:
            async with self._sessionmaker.begin() as session:
                await session.execute(insert(Approval), row)
        except IntegrityError:
            pass  # asked already, by an attempt that did not get to park the run
        found = await self.get(new.id)
        if found is None:  # the run (and its approvals) went with its conversation meanwhile
            raise IntegrityError("approval", {}, Exception(f"approval {new.id} is gone"))
        return found

    async def park(self, run_id: str, attempt: int, worker_id: str) -> ParkResult:
        """Let the run wait for its approvals, held by no worker (A-02); ``released`` when every
        one of them is decided already (it goes on at once), ``cancelled`` when its user cancelled
        it meanwhile (the caller closes it), ``lost`` if ``attempt`` does not hold it any more.
        A run that waits has its listeners told in the same transaction (``RunNotices``)."""
        held = (
            Run.id == run_id,
            Run.status == "running",
            Run.attempt == attempt,
            Run.worker_id == worker_id,
        )
        async with self._sessionmaker.begin() as session:
            parked = await session.execute(
                update(Run)
                .where(*held, Run.cancel_requested.is_(False))
                .values(status="waiting", worker_id=None, lease_expires_at=None)
                .returning(NOTIFY)
            )
            row = parked.first()
            if row is None:
                still_ours = await session.scalar(select(Run.id).where(*held))
                return "cancelled" if still_ours is not None else "lost"
            if await _go_on_if_decided(session, run_id):
                return "released"
            # RETURNING's NOTIFY may predate a push config committed while the row was waited for
            # (PostgreSQL): asked again, with the row held (``has_push_configs``).
            if self._notices is not None and (row.notify or await has_push_configs(session, run_id)):
                await self._notices.run_changed(session, run_id)
            return "waiting"

    async def decide(
        self,
        found: ApprovalRecord,
        *,
        status: Literal["approved", "denied"],
        reason: str | None,
        decided_args: Mapping[str, Any],
        decided_by: str,
    ) -> tuple[ApprovalRecord, bool]:
        """Decide a pending approval (A-03); returns it and whether its run goes on now (no
        approval of it pending any more). Raises ``ApprovalClosedError`` when it was decided,
        expired or closed before: the first decision stands. ``found``: the approval as the
        caller read it (its run and what it asked for do not change)."""
        approval_id = found.id
        now = utcnow()
        async with self._sessionmaker.begin() as session:
            await _lock_run(session, found.run_id)
            decided = await session.execute(
                update(Approval)
                .where(
                    Approval.id == approval_id,
                    Approval.kind == "approval",
                    Approval.status == "pending",
                    Approval.expires_at > now,
                    _RUN_ACTIVE,
                )
                .values(
                    status=status,
                    reason=reason,
                    decided_args=dict(decided_args),
                    decided_by=decided_by,
                    decided_at=now,
                )
            )
            if not decided.rowcount:  # type: ignore[attr-defined]
                current = await session.scalar(select(Approval.status).where(Approval.id == approval_id))
                if current == "pending":
                    run_status = await session.scalar(select(Run.status).where(Run.id == found.run_id))
                    current = "expired" if run_status in ("running", "waiting") else "closed with its run"
                raise ApprovalClosedError(str(current or "gone"))
            goes_on = await _go_on_if_decided(session, found.run_id)
            if goes_on:
                await self._tell(session, found.run_id)
        decided_record = replace(
            found,
            status=status,
            reason=reason,
            decided_args=dict(decided_args),
            decided_by=decided_by,
            decided_at=now,
        )
        return decided_record, goes_on

    async def answer(self, found: ApprovalRecord, output: Mapping[str, Any]) -> tuple[ApprovalRecord, bool]:
        """Store the result of a client call that waits for it (FACES.md C-03): ``output`` is
        ``{"output": any}`` or ``{"error": str}``. Returns the call and whether its run goes on
        now (nothing of it pending any more). Raises ``ApprovalClosedError`` when the call was
        answered, expired or closed with its run before: the first result stands."""
        now = utcnow()
        async with self._sessionmaker.begin() as session:
            await _lock_run(session, found.run_id)
            answered = await session.execute(
                update(Approval)
                .where(
                    Approval.id == found.id,
                    Approval.kind == "client",
                    Approval.status == "pending",
                    Approval.expires_at > now,
                    _RUN_ACTIVE,
                )
                .values(status="answered", output=dict(output), decided_at=now)
            )
            if not answered.rowcount:  # type: ignore[attr-defined]
                current = await session.scalar(select(Approval.status).where(Approval.id == found.id))
                if current == "pending":
                    run_status = await session.scalar(select(Run.status).where(Run.id == found.run_id))
                    current = "expired" if run_status in ("running", "waiting") else "closed with its run"
                raise ApprovalClosedError(str(current or "gone"))
            goes_on = await _go_on_if_decided(session, found.run_id)
            if goes_on:
                await self._tell(session, found.run_id)
        return replace(found, status="answered", output=dict(output), decided_at=now), goes_on

    async def client_call(self, conversation_id: str, call_id: str) -> ApprovalRecord | None:
        """The conversation's latest client call of id ``call_id`` (ids are unique within a run)."""
        rows = await self._all(
            select(Approval)
            .where(
                Approval.conversation_id == conversation_id,
                Approval.call_id == call_id,
                Approval.kind == "client",
            )
            .order_by(Approval.created_at.desc())
            .limit(1)
        )
        return rows[0] if rows else None

    async def expire_due(self, now: datetime | None = None, *, limit: int = 100) -> tuple[int, list[str]]:
        """Expire the pending approvals whose time ran out (A-04); returns how many, and the runs
        that go on because of it."""
        now = now if now is not None else utcnow()
        async with self._sessionmaker() as session:
            run_ids = list(
                await session.scalars(
                    select(Approval.run_id)
                    .where(Approval.status == "pending", Approval.expires_at <= now)
                    .group_by(Approval.run_id)
                    .order_by(func.min(Approval.expires_at))
                    .limit(limit)
                )
            )
        expired = 0
        resumed: list[str] = []
        for run_id in run_ids:
            async with self._sessionmaker.begin() as session:
                await _lock_run(session, run_id)
                result = await session.execute(
                    update(Approval)
                    .where(
                        Approval.run_id == run_id, Approval.status == "pending", Approval.expires_at <= now
                    )
                    .values(
                        status="expired",
                        reason=case(
                            (Approval.kind == "client", "no result came in time"),
                            else_="nobody decided in time",
                        ),
                        decided_at=now,
                    )
                )
                expired += result.rowcount  # type: ignore[attr-defined]
                if await _go_on_if_decided(session, run_id):
                    resumed.append(run_id)
                    await self._tell(session, run_id)
        return expired, resumed

    async def close_orphans(self, *, limit: int = 500) -> int:
        """Mark ``cancelled`` the pending approvals of runs that ended (housekeeping: they count
        as closed already, see ``_RUN_ACTIVE``)."""
        async with self._sessionmaker.begin() as session:
            ids = list(
                await session.scalars(
                    select(Approval.id).where(Approval.status == "pending", ~_RUN_ACTIVE).limit(limit)
                )
            )
            if not ids:
                return 0
            result = await session.execute(
                update(Approval)
                .where(Approval.id.in_(ids), Approval.status == "pending")
                .values(status="cancelled", reason="the run ended", decided_at=utcnow())
            )
        return int(result.rowcount)  # type: ignore[attr-defined]

    async def get(self, approval_id: str) -> ApprovalRecord | None:
        async with self._sessionmaker() as session:
            row = (
                await session.execute(select(Approval).where(Approval.id == approval_id))
            ).scalar_one_or_none()
            return _record(row) if row is not None else None

    async def _tell(self, session: AsyncSession, run_id: str) -> None:
        """A waiting run goes on (running, held by no worker): its push configs are told
        (``RunNotices``; a run webhook is not, N-07 posts waits and ends)."""
        if self._notices is not None and await session.scalar(select(NOTIFY).where(Run.id == run_id)):
            await self._notices.run_changed(session, run_id)

    @staticmethod
    async def pending_in(session: AsyncSession, run_id: str) -> list[ApprovalRecord]:
        """The run's open approvals and client calls, oldest first, read in the caller's
        transaction (what a run that starts waiting waits for)."""
        rows = await session.scalars(
            select(Approval)
            .where(Approval.run_id == run_id, Approval.status == "pending")
            .order_by(Approval.created_at, Approval.id)
        )
        return [_record(row) for row in rows]

    async def of_run(self, run_id: str) -> list[ApprovalRecord]:
        return await self._all(
            select(Approval).where(Approval.run_id == run_id).order_by(Approval.created_at)
        )

    async def pending(
        self,
        *,
        owner: str | None = None,
        conversation_id: str | None = None,
        run_ids: Sequence[str] = (),
        kind: str = "approval",
    ) -> list[ApprovalRecord]:
        """Pending approvals (``kind`` ``client``: client calls that wait for their results),
        oldest first: an owner's, a conversation's, or some runs'."""
        query = select(Approval).where(Approval.status == "pending", Approval.kind == kind, _RUN_ACTIVE)
        if owner is not None:
            query = query.where(Approval.owner == owner)
        if conversation_id is not None:
            query = query.where(Approval.conversation_id == conversation_id)
        if run_ids:
            query = query.where(Approval.run_id.in_(list(run_ids)))
        return await self._all(query.order_by(Approval.created_at, Approval.id))

    async def waiting_of(self, run_id: str) -> tuple[list[ApprovalRecord], list[ApprovalRecord]]:
        """What ``run_id`` waits for, in one read: its pending approvals and its pending client
        calls (each oldest first, as ``pending`` lists them)."""
        query = select(Approval).where(Approval.status == "pending", Approval.run_id == run_id, _RUN_ACTIVE)
        records = await self._all(query.order_by(Approval.created_at, Approval.id))
        return [r for r in records if r.kind == "approval"], [r for r in records if r.kind == "client"]

    async def count_pending(self) -> int:
        async with self._sessionmaker() as session:
            query = (
                select(func.count())
                .select_from(Approval)
                .where(Approval.status == "pending", Approval.kind == "approval", _RUN_ACTIVE)
            )
            return int(await session.scalar(query) or 0)

    async def _all(self, query: Any) -> list[ApprovalRecord]:
        async with self._sessionmaker() as session:
            return [_record(row) for row in await session.scalars(query)]
