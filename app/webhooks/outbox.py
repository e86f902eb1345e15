"""The webhooks' outbox (FACES.md N-06, N-07): the deliveries the service owes, in the database.

A delivery is stored by ``enqueue`` in the transaction of the change it tells of (a run that waits
or ends), so it exists exactly when that change was committed, and survives any worker and Redis.
Any worker claims due deliveries (``Outbox.claim``): the claim counts an attempt and holds the row
under a lease (``claimed_by``, ``claimed_until``), so two workers never make the same attempt at
once, and the claims of a worker that died come back when their lease runs out. PostgreSQL's
``FOR UPDATE SKIP LOCKED`` lets workers claiming at the same moment take different rows; SQLite has
one writer, and the claim is one conditional UPDATE. A claim skips the hosts a worker already
makes enough attempts at (``skip_hosts``: each row keeps its URL's ``host``). The worker renews its
claims while it delivers, then records the outcome, fenced by its claim: an attempt whose claim was
lost records nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Table, Update, and_, case, delete, func, insert, or_, select, true, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import WebhookDelivery, utcnow

_deliveries: Table = WebhookDelivery.__table__  # type: ignore[assignment]
_d = _deliveries.c

KINDS = ("run", "a2a_push")
"""``run``: a run webhook (N-07); ``a2a_push``: an A2A push notification (N-06)."""

_PENDING = and_(_d.delivered_at.is_(None), _d.given_up_at.is_(None))


def new_delivery_id() -> str:
    return "wh_" + secrets.token_urlsafe(16)


def host_of(url: str) -> str:
    """The host a delivery to ``url`` goes to, as a worker counts its attempts per host: the name
    in lower case, no trailing dot ("" if the URL has none)."""
    try:
        return (urlsplit(url).hostname or "").rstrip(".")
    except ValueError:
        return ""


@dataclass(frozen=True, slots=True)
class NewDelivery:
    """A POST owed to ``url``: ``body`` (JSON text) is sent as it is on every attempt, with
    ``headers`` of its own (an A2A config's credentials)."""

    kind: str
    run_id: str
    event: str
    url: str
    body: str
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Delivery:
    id: str
    kind: str
    run_id: str
    event: str
    url: str
    host: str
    """``host_of(url)``, as stored (worked out from the URL for rows stored without it)."""
    headers: dict[str, str]
    body: str
    created_at: datetime
    next_attempt_at: datetime
    attempts: int
    claimed_by: str | None
    claimed_until: datetime | None
    delivered_at: datetime | None
    last_error: str | None
    given_up_at: datetime | None


def _delivery(row: Any) -> Delivery:
    return Delivery(
        id=row.id,
        kind=row.kind,
        run_id=row.run_id,
        event=row.event,
        url=row.url,
        host=row.host if row.host is not None else host_of(row.url),
        headers=dict(row.headers),
        body=row.body,
        created_at=row.created_at,
        next_attempt_at=row.next_attempt_at,
        attempts=row.attempts,
        claimed_by=row.claimed_by,
        claimed_until=row.claimed_until,
        delivered_at=row.delivered_at,
        last_error=row.last_error,
        given_up_at=row.given_up_at,
    )


async def enqueue(
    session: AsyncSession, deliveries: Sequence[NewDelivery], now: datetime | None = None
) -> list[str]:
    """Store ``deliveries``, due at once, in the caller's transaction; their ids, in order."""
    if not deliveries:
        return []
    now = now if now is not None else utcnow()
    rows: list[dict[str, Any]] = []
    for i, new in enumerate(deliveries):
        if new.kind not in KINDS:
            raise ValueError(f"unknown delivery kind {new.kind!r}")
        rows.append(
            {
                "id": new_delivery_id(),
                "kind": new.kind,
                "run_id": new.run_id,
                "event": new.event,
                "url": new.url,
                "host": host_of(new.url),
                "headers": dict(new.headers),
                "body": new.body,
                # Apart by a microsecond each: claimed in the order they were queued.
                "created_at": now + timedelta(microseconds=i),
                "next_attempt_at": now + timedelta(microseconds=i),
                "attempts": 0,
            }
        )
    await session.execute(insert(_deliveries), rows)
    return [row["id"] for row in rows]


def _due(now: datetime) -> Any:
    return and_(
        _PENDING,
        _d.next_attempt_at <= now,
        or_(_d.claimed_until.is_(None), _d.claimed_until < now),
    )


def _not_to(hosts: Collection[str]) -> Any:
    """Deliveries to none of ``hosts`` (those stored without a host are not told apart)."""
    return or_(_d.host.is_(None), _d.host.not_in(sorted(hosts))) if hosts else true()


def _claim(postgres: bool, limit: int, now: datetime, skip_hosts: Collection[str]) -> Update:
    """``UPDATE`` of the ``limit`` deliveries due longest (to none of ``skip_hosts``), still due,
    returning their rows."""
    due = (
        select(_d.id)
        .where(_due(now), _not_to(skip_hosts))
        .order_by(_d.next_attempt_at, _d.id)
        .limit(limit)
    )
    if postgres:
        # Rows another worker is claiming are skipped, not waited for. A materialised CTE, not
        # ``IN (subquery)``, which PostgreSQL may run again per row (as app.db.repositories.queue).
        oldest = due.with_for_update(skip_locked=True).cte("due")
        chosen = select(oldest.prefix_with("MATERIALIZED").c.id)
    else:
        # One writer at a time: the statement's own WHERE is the whole check.
        chosen = due
    return update(_deliveries).where(_d.id.in_(chosen), _due(now)).returning(*_deliveries.c)


def _held(delivery: Delivery, worker_id: str) -> Any:
    """The delivery's row while ``worker_id``'s claim of this attempt holds it."""
    return and_(
        _d.id == delivery.id,
        _d.claimed_by == worker_id,
        _d.attempts == delivery.attempts,
        _PENDING,
    )


def _prunable(done_at: Any, before: datetime, limit: int) -> Any:
    """The ids of up to ``limit`` deliveries whose ``done_at`` (made or given up) is before
    ``before``: a range of that column's index."""
    return select(_d.id).where(done_at < before).limit(limit)


class Outbox:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def claim(
        self,
        worker_id: str,
        limit: int,
        lease_s: float,
        *,
        now: datetime | None = None,
        skip_hosts: Collection[str] = (),
    ) -> list[Delivery]:
        """Claim up to ``limit`` due deliveries for ``worker_id``'s next attempt at each, held for
        ``lease_s``; oldest due first, none to ``skip_hosts``. A delivery claimed by a live worker
        is not due."""
        if limit <= 0:
            return []
        now = now if now is not None else utcnow()
        async with self._sessionmaker.begin() as session:
            postgres = session.get_bind().dialect.name == "postgresql"
            claim = _claim(postgres, limit, now, skip_hosts).values(
                claimed_by=worker_id,
                claimed_until=now + timedelta(seconds=lease_s),
                attempts=_d.attempts + 1,
            )
            rows = await session.execute(claim)
            return sorted((_delivery(row) for row in rows), key=lambda d: (d.next_attempt_at, d.id))

    async def renew(
        self, deliveries: Sequence[Delivery], worker_id: str, lease_s: float
    ) -> set[str]:
        """Extend ``worker_id``'s claims of ``deliveries`` (the attempts it makes); the ids of
        those it still holds."""
        if not deliveries:
            return set()
        held = or_(*(_held(d, worker_id) for d in deliveries))
        async with self._sessionmaker.begin() as session:
            rows = await session.execute(
                update(_deliveries)
                .where(held)
                .values(claimed_until=utcnow() + timedelta(seconds=lease_s))
                .returning(_d.id)
            )
            return {row.id for row in rows}

    async def delivered(self, delivery: Delivery, worker_id: str) -> bool:
        """Record the attempt's success. Also when the claim ran out meanwhile: the receiver has
        it, and whoever claimed it since delivers it again at most (at least once)."""
        now = utcnow()
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(_deliveries)
                .where(_d.id == delivery.id, _PENDING)
                .values(
                    delivered_at=now,
                    claimed_by=None,
                    claimed_until=None,
                    last_error=None,
                )
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def failed(
        self, delivery: Delivery, worker_id: str, error: str, *, retry_at: datetime | None
    ) -> bool:
        """Record the attempt's failure: the next attempt at ``retry_at``, or none (given up).
        False when ``worker_id`` no longer held this attempt (nothing recorded)."""
        now = utcnow()
        values: dict[str, Any] = {"claimed_by": None, "claimed_until": None, "last_error": error[:1000]}
        if retry_at is None:
            values["given_up_at"] = now
        else:
            values["next_attempt_at"] = retry_at
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(_deliveries).where(_held(delivery, worker_id)).values(**values)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def release(self, deliveries: Sequence[Delivery], worker_id: str) -> int:
        """Let go of ``worker_id``'s claims of ``deliveries`` (a worker that stops): due at once
        for another worker, their attempt counted (it may have reached the receiver)."""
        if not deliveries:
            return 0
        held = or_(*(_held(d, worker_id) for d in deliveries))
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(_deliveries).where(held).values(claimed_by=None, claimed_until=None)
            )
        return int(result.rowcount)  # type: ignore[attr-defined]

    async def hand_back(self, deliveries: Sequence[Delivery], worker_id: str) -> int:
        """Undo ``worker_id``'s claims of ``deliveries``, just taken, whose attempts it will not
        make now (their host has enough of its attempts under way): due as before, no attempt
        counted. A row stored without its host gets it, so that the next claim skips it."""
        if not deliveries:
            return 0
        held = or_(*(_held(d, worker_id) for d in deliveries))
        hosts = {d.id: d.host for d in deliveries}
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(_deliveries)
                .where(held)
                .values(
                    claimed_by=None,
                    claimed_until=None,
                    attempts=_d.attempts - 1,
                    host=func.coalesce(_d.host, case(hosts, value=_d.id)),
                )
            )
        return int(result.rowcount)  # type: ignore[attr-defined]

    async def pending_count(self) -> int:
        """Deliveries neither made nor given up, across the service (the queue's depth)."""
        async with self._sessionmaker() as session:
            return int(await session.scalar(select(func.count()).where(_PENDING)) or 0)

    async def next_due(self, *, skip_hosts: Collection[str] = ()) -> datetime | None:
        """When the earliest pending delivery (to none of ``skip_hosts``) is due (None: none is
        pending); one claimed is due when its claim lapses, at the earliest."""
        due_at = case((_d.claimed_until > _d.next_attempt_at, _d.claimed_until), else_=_d.next_attempt_at)
        async with self._sessionmaker() as session:
            due: datetime | None = await session.scalar(
                select(func.min(due_at)).where(_PENDING, _not_to(skip_hosts))
            )
        return due

    async def prune(self, before: datetime, *, limit: int = 500) -> int:
        """Delete up to ``limit`` deliveries made or given up before ``before``, in one
        transaction; how many. Fewer than ``limit``: none is left."""
        gone = 0
        async with self._sessionmaker.begin() as session:
            for done_at in (_d.delivered_at, _d.given_up_at):
                result = await session.execute(
                    delete(_deliveries).where(_d.id.in_(_prunable(done_at, before, limit - gone)))
                )
                gone += int(result.rowcount)  # type: ignore[attr-defined]
                if gone >= limit:
                    break
        return gone
