"""The run queue (RUNS.md Q-01, Q-02): whether a starting run runs now or queues, and the queued
runs a worker with room takes, oldest first.

A run queues when the worker that takes its start is full, when its owner holds
``MAX_ACTIVE_RUNS_PER_OWNER`` running runs, or when runs queue already (they go first). A queued
run is a row held by no worker; whichever worker has room takes it (``RunQueue.take``), the
database deciding between workers. On PostgreSQL an owner's running runs, and the queue's length,
are counted under a transaction-scoped advisory lock, so that two workers starting or taking runs
of one owner at once cannot both pass its cap; SQLite has one writer at a time anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Select, and_, bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import QueueFullError
from app.db.models import Run, utcnow
from app.db.repositories.rows import RunRecord, _run_record, _runs

OWNER_LOCK = 0x4153_0001
"""Advisory-lock class of an owner's running runs (PostgreSQL; the key is a hash of the owner)."""
QUEUE_LOCK = 0x4153_0002
"""Advisory-lock class of the queue's length (MAX_QUEUED_RUNS)."""

_QUEUED = select(func.count()).select_from(_runs).where(_runs.c.status == "queued")
_OWNER_RUNNING = (
    select(func.count())
    .select_from(_runs)
    .where(_runs.c.owner == bindparam("b_owner"), _runs.c.status == "running")
)
_MAKE_QUEUED = (
    update(_runs)
    .where(_runs.c.id == bindparam("b_id"))
    .values(status="queued", worker_id=None, lease_expires_at=None)
)


@dataclass(frozen=True, slots=True)
class Admission:
    """What decides a starting run's place (RUNS.md Q-01, Q-02): whether the worker that takes it
    has room, the owners' cap on running runs (None: none) and the queue's bound."""

    room: bool
    per_owner: int | None = None
    max_queued: int = 10_000


class _Refused(Exception):
    """Undoes a take whose owner turned out to be at its cap."""


def _postgres(session: AsyncSession) -> bool:
    return session.get_bind().dialect.name == "postgresql"


async def _lock(session: AsyncSession, kind: int, key: str) -> None:
    if _postgres(session):
        await session.execute(select(func.pg_advisory_xact_lock(kind, func.hashtext(key))))


async def admit(session: AsyncSession, run_id: str, owner: str, admission: Admission) -> int | None:
    """In the transaction that starts run ``run_id`` (its row inserted as running, which on
    SQLite holds the write lock): None if it runs now; else its position in the queue, its row
    queued, held by nobody. It queues behind the runs that could start before it (not those of
    owners at their cap). A queued start ends its transaction with ``check_bound``."""
    over_cap = False
    if admission.per_owner is not None:
        await _lock(session, OWNER_LOCK, owner)
        running = await session.scalar(_OWNER_RUNNING, {"b_owner": owner}) or 0
        over_cap = running > admission.per_owner  # this run's row counts
    ahead = await session.scalar(_queued_ahead(admission.per_owner, run_id)) or 0
    if admission.room and not over_cap and not ahead:
        return None
    await session.execute(_MAKE_QUEUED, {"b_id": run_id})
    return ahead + 1


async def check_bound(session: AsyncSession, max_queued: int) -> None:
    """Last in a queued start's transaction: raises ``QueueFullError`` (the transaction keeps
    nothing) if more than ``max_queued`` runs would wait with it (Q-02). On PostgreSQL counted
    under a lock held only until the commit that follows, so that starts queueing at once are
    counted one after the other."""
    await _lock(session, QUEUE_LOCK, "")
    if (await session.scalar(_QUEUED) or 0) > max_queued:  # this run's row counts
        raise QueueFullError(max_queued)


def _queued_ahead(per_owner: int | None, run_id: str) -> Select[Any]:
    """How many queued runs may start before new run ``run_id``: all of them, but those of
    owners at their cap without it (they wait without holding up the others, Q-01)."""
    if per_owner is None:
        return _QUEUED
    return _QUEUED.where(_runs.c.owner.not_in(_full_owners(per_owner, but=run_id)))


def _full_owners(per_owner: int, *, but: str | None = None) -> Select[Any]:
    """The owners who hold ``per_owner`` running runs (run ``but`` not counted)."""
    running = Run.status == "running" if but is None else and_(Run.status == "running", Run.id != but)
    return select(Run.owner).where(running).group_by(Run.owner).having(func.count() >= per_owner)


class RunQueue:
    """The queued runs, across every worker."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def next(self, limit: int, *, per_owner: int | None = None) -> list[RunRecord]:
        """Up to ``limit`` queued runs, oldest first, those of owners at their cap left out."""
        query = select(Run).where(Run.status == "queued")
        if per_owner is not None:
            query = query.where(Run.owner.not_in(_full_owners(per_owner)))
        query = query.order_by(Run.created_at, Run.id).limit(max(0, limit))
        async with self._sessionmaker() as session:
            return [_run_record(row) for row in await session.scalars(query)]

    async def take(
        self, run: RunRecord, worker_id: str, lease_s: float, *, per_owner: int | None = None
    ) -> RunRecord | None:
        """Start queued ``run`` on ``worker_id`` (its first attempt): None if another worker took
        it first, it was cancelled, or its owner is at its cap now."""
        now = utcnow()
        try:
            async with self._sessionmaker.begin() as session:
                if per_owner is not None:
                    await _lock(session, OWNER_LOCK, run.owner)
                result = await session.execute(
                    update(Run)
                    .where(Run.id == run.id, Run.status == "queued")
                    .values(
                        status="running",
                        worker_id=worker_id,
                        lease_expires_at=now + timedelta(seconds=lease_s),
                    )
                )
                if not result.rowcount:  # type: ignore[attr-defined]
                    return None
                if per_owner is not None:
                    running = await session.scalar(_OWNER_RUNNING, {"b_owner": run.owner}) or 0
                    if running > per_owner:  # this run's row counts
                        raise _Refused
                row = (await session.execute(select(_runs).where(_runs.c.id == run.id))).one()
                return _run_record(row)
        except _Refused:
            return None

    async def length(self) -> int:
        async with self._sessionmaker() as session:
            return int(await session.scalar(_QUEUED) or 0)
