"""The run queue (RUNS.md Q-01, Q-02): whether a starting run runs now or queues, and the queued
runs a worker with room takes, oldest first.

A run queues when the worker that takes its start is full, when its owner holds
``MAX_ACTIVE_RUNS_PER_OWNER`` running runs, or when runs queue already (they go first). A queued
run is a row held by no worker; whichever worker has room takes it, the database deciding between
workers: a worker claims a batch of them in one statement, skipping rows another worker is
claiming (``RunQueue.take_next``). On PostgreSQL an owner's running runs are
counted under a transaction-scoped advisory lock, so that two workers starting or taking runs of one
owner at once cannot both pass its cap; SQLite has one writer at a time anyway.

The queue's bound (``check_bound``) is exact without making every queued start of the service wait
for the one before it: far from the bound, starts count under a *shared* lock, concurrently; near
it (within the server's ``max_connections``, the most transactions that can be in flight at once,
each adding at most one run), a start counts under the *exclusive* lock, after every start in
flight has committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Integer, Select, Update, and_, bindparam, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import QueueFullError
from app.db.models import Run, utcnow
from app.db.repositories.rows import RunRecord, _run_record, _runs

OWNER_LOCK = 0x4153_0001
"""Advisory-lock class of an owner's running runs (PostgreSQL; the key is a hash of the owner)."""
QUEUE_LOCK = 0x4153_0002
"""Advisory-lock class of the queue's length (MAX_QUEUED_RUNS)."""

_QUEUED = select(func.count()).select_from(_runs).where(_runs.c.status == "queued")
_QUEUED_AND_SLACK = (
    select(func.count(), func.current_setting("max_connections").cast(Integer))
    .select_from(_runs)
    .where(_runs.c.status == "queued")
)
_OWNER_RUNNING = (
    select(func.count())
    .select_from(_runs)
    .where(_runs.c.owner == bindparam("b_owner"), _runs.c.status == "running")
)
_LOCK_OWNERS = text(
    "SELECT count(pg_advisory_xact_lock(:kind, k)) FROM"
    " (SELECT DISTINCT hashtext(o) AS k FROM unnest(CAST(:owners AS text[])) AS o ORDER BY k) AS keys"
)
_QUEUED_AGAIN = {"status": "queued", "worker_id": None, "lease_expires_at": None}
_MAKE_QUEUED = update(_runs).where(_runs.c.id == bindparam("b_id")).values(_QUEUED_AGAIN)


@dataclass(frozen=True, slots=True)
class Admission:
    """What decides a starting run's place (RUNS.md Q-01, Q-02): whether the worker that takes it
    has room, the owners' cap on running runs (None: none) and the queue's bound."""

    room: bool
    per_owner: int | None = None
    max_queued: int = 10_000


_slack: dict[str, int] = {}
"""Each PostgreSQL server's ``max_connections`` (by host and port), once a start has read it
(``check_bound``)."""


def _server(bind: Any) -> str:
    return f"{bind.url.host}:{bind.url.port}"


def start_exclusive(bind: Any, max_queued: int) -> bool:
    """Whether a queued start on the database of ``bind`` (an engine) should count the queue under
    the exclusive lock at once: when the bound is so low that the shared count would always send it
    back (``NearBound``)."""
    slack = _slack.get(_server(bind)) if bind is not None else None
    return slack is not None and max_queued <= slack


class NearBound(Exception):
    """A queued start counted the queue under the shared lock and found it near its bound: start
    again, counting under the exclusive lock (``check_bound(..., exclusive=True)``)."""


def _postgres(session: AsyncSession) -> bool:
    return session.get_bind().dialect.name == "postgresql"


async def _lock(session: AsyncSession, kind: int, key: str, *, shared: bool = False) -> None:
    if _postgres(session):
        take = func.pg_advisory_xact_lock_shared if shared else func.pg_advisory_xact_lock
        await session.execute(select(take(kind, func.hashtext(key))))


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


async def check_bound(session: AsyncSession, max_queued: int, *, exclusive: bool = False) -> None:
    """Last in a queued start's transaction: raises ``QueueFullError`` (the transaction keeps
    nothing) if more than ``max_queued`` runs would wait with it (Q-02).

    On PostgreSQL the count is taken under ``QUEUE_LOCK``, held until the commit that follows.
    Shared (``exclusive`` false), starts count at once, so the count is exact only as long as the
    starts in flight cannot pass the bound together: if the queue, with one run more for every
    connection the server allows, could, this raises ``NearBound`` and the start must be made
    again with ``exclusive``, which waits for the shared holders to commit and keeps new ones out
    until its own commit."""
    if not _postgres(session):  # one writer at a time: the count is exact
        queued = await session.scalar(_QUEUED) or 0
    else:
        await _lock(session, QUEUE_LOCK, "", shared=not exclusive)
        queued, slack = (await session.execute(_QUEUED_AND_SLACK)).one()
        _slack[_server(session.get_bind())] = slack
        if not exclusive and queued + slack > max_queued:
            raise NearBound
    if queued > max_queued:  # this run's row counts
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


async def _within_caps(session: AsyncSession, taken: list[RunRecord], per_owner: int) -> list[RunRecord]:
    """Of the runs just taken (``RunQueue.take_next``), those that keep their owners within
    ``per_owner`` running runs, oldest first; the others are queued again in this transaction."""
    owners = sorted({run.owner for run in taken})
    if _postgres(session):
        # In the order of the lock keys (not of the names, which two keys could cross): two
        # workers' batches never wait for each other's locks.
        await session.execute(_LOCK_OWNERS, {"kind": OWNER_LOCK, "owners": owners})
    counted = select(_runs.c.owner, func.count()).where(
        _runs.c.owner.in_(owners), _runs.c.status == "running"
    )
    running: dict[str, int] = {
        owner: count for owner, count in await session.execute(counted.group_by(_runs.c.owner))
    }
    for run in taken:  # counted above already: what the owner ran before this batch
        running[run.owner] -= 1
    kept: list[RunRecord] = []
    for run in taken:
        if running[run.owner] < per_owner:
            running[run.owner] += 1
            kept.append(run)
    if len(kept) < len(taken):
        kept_ids = {run.id for run in kept}
        back = [run.id for run in taken if run.id not in kept_ids]
        await session.execute(update(_runs).where(_runs.c.id.in_(back)).values(_QUEUED_AGAIN))
    return kept


def _eligible(per_owner: int | None) -> Select[Any]:
    """The ids of the queued runs that may start now, oldest first."""
    queued = select(_runs.c.id).where(_runs.c.status == "queued")
    if per_owner is not None:
        queued = queued.where(_runs.c.owner.not_in(_full_owners(per_owner)))
    return queued.order_by(_runs.c.created_at, _runs.c.id)


def _claim(eligible: Select[Any], limit: int, postgres: bool) -> Update:
    """``UPDATE`` of the ``limit`` oldest of ``eligible`` (still queued), returning their rows."""
    if postgres:
        # Rows another worker is claiming are skipped. A CTE, not ``IN (subquery)``: PostgreSQL
        # may run such a subquery again for each row it updates, each time locking the next
        # oldest (an UPDATE of more rows than ``limit``).
        oldest = eligible.limit(limit).with_for_update(skip_locked=True).cte("oldest")
        chosen = select(oldest.prefix_with("MATERIALIZED").c.id)
    else:
        # A statement that starts with UPDATE: Python's sqlite3 begins the transaction before it
        # (not before one that starts with WITH), so the caps below are checked in the same one.
        chosen = eligible.limit(limit)
    return update(_runs).where(_runs.c.id.in_(chosen), _runs.c.status == "queued").returning(*_runs.c)


class RunQueue:
    """The queued runs, across every worker."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def take_next(
        self, limit: int, worker_id: str, lease_s: float, *, per_owner: int | None = None
    ) -> list[RunRecord]:
        """Start up to ``limit`` queued runs on ``worker_id`` (their first attempts), oldest
        first, in one transaction; the runs taken, oldest first.

        Runs another worker is taking right now are skipped, not waited for (PostgreSQL's
        ``SKIP LOCKED``; SQLite has one writer): workers taking at once take different runs. Runs of
        owners at their cap are left out, and no owner passes ``per_owner`` running runs: the
        runs of one owner beyond its cap in this batch are put back, counted under the owner's
        lock as ``admit`` counts them."""
        if limit <= 0:
            return []
        async with self._sessionmaker.begin() as session:
            claim = _claim(_eligible(per_owner), limit, _postgres(session)).values(
                status="running", worker_id=worker_id, lease_expires_at=utcnow() + timedelta(seconds=lease_s)
            )
            taken = sorted(
                (_run_record(row) for row in await session.execute(claim)), key=lambda r: (r.created_at, r.id)
            )
            if per_owner is None or not taken:
                return taken
            return await _within_caps(session, taken, per_owner)

    async def waiting(self, limit: int, *, per_owner: int | None = None) -> int:
        """How many queued runs (up to ``limit``) a worker could take now: those of owners at
        their cap left out."""
        counted = select(func.count()).select_from(_eligible(per_owner).limit(limit).subquery())
        async with self._sessionmaker() as session:
            return int(await session.scalar(counted) or 0)

    async def length(self) -> int:
        async with self._sessionmaker() as session:
            return int(await session.scalar(_QUEUED) or 0)
