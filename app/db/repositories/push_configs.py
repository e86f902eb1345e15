"""``PushConfigRepo``: the A2A push notification configs of tasks (FACES.md N-06).

A task is a run; its configs say where the service posts the task's status changes (through the
webhooks' outbox, ``app.webhooks``) and with which credentials. They belong to the run's owner: a
config of another owner's task is not found, as the task is not. A config given with a new task is
stored in the transaction that starts its run (``RunRepo.start(push_configs=...)``), so that no
change of the task can come before it. A task has at most ``MAX_PUSH_CONFIGS``.

A config is owed the changes committed after it. ``create`` takes the run's row first: a close or
park that waits for that row is told of the config (``has_push_configs``, read after its UPDATE);
one that committed before owes it nothing. A config of a task that has ended is kept (as the SDK's
own handler does; the TCK's push tests create theirs on a completed task) and is never posted to:
nothing changes any more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, delete, exists, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import PersistenceError
from app.db.models import PushConfig, Run, utcnow

_push_configs: Table = PushConfig.__table__  # type: ignore[assignment]

MAX_PUSH_CONFIGS = 10
"""A task's configs at most: each change of the run owes every one of them a delivery."""


class PushConfigLimitError(PersistenceError):
    """The task has ``MAX_PUSH_CONFIGS`` configs already (one of the same id would replace its own);
    nothing was stored."""

    def __init__(self) -> None:
        super().__init__(f"a task may have at most {MAX_PUSH_CONFIGS} push notification configs")


@dataclass(frozen=True, slots=True)
class NewPushConfig:
    """A push notification config as a client gives it: ``authentication`` is the A2A
    ``AuthenticationInfo`` (``{"scheme", "credentials"}``), or None."""

    config_id: str
    url: str
    token: str | None = None
    authentication: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PushConfigRecord:
    run_id: str
    owner: str
    config_id: str
    url: str
    token: str | None
    authentication: dict[str, Any] | None
    created_at: datetime


def _record(row: Any) -> PushConfigRecord:
    return PushConfigRecord(
        run_id=row.run_id,
        owner=row.owner,
        config_id=row.config_id,
        url=row.url,
        token=row.token,
        authentication=dict(row.authentication) if row.authentication is not None else None,
        created_at=row.created_at,
    )


async def insert_push_configs(
    session: AsyncSession, run_id: str, owner: str, configs: Sequence[NewPushConfig]
) -> None:
    """Store ``configs`` of run ``run_id`` in the caller's transaction, each replacing the run's
    config of the same id."""
    if not configs:
        return
    ids = [c.config_id for c in configs]
    await session.execute(
        delete(_push_configs).where(_push_configs.c.run_id == run_id, _push_configs.c.config_id.in_(ids))
    )
    now = utcnow()
    latest = {c.config_id: c for c in configs}  # the same id twice: the last one stands
    await session.execute(
        insert(_push_configs),
        [
            {
                "run_id": run_id,
                "owner": owner,
                "config_id": c.config_id,
                "url": c.url,
                "token": c.token,
                "authentication": dict(c.authentication) if c.authentication is not None else None,
                "created_at": now,
            }
            for c in latest.values()
        ],
    )


async def has_push_configs(session: AsyncSession, run_id: str) -> bool:
    """Whether the run has configs, read in the caller's transaction by a statement of its own.

    A close or park returns ``NOTIFY`` from its UPDATE, but on PostgreSQL that UPDATE's subquery
    sees the snapshot taken before it waited for the run's row: a config that ``create`` committed
    meanwhile (holding that row) is seen only by a later statement, as this one, while the row
    lock is still held."""
    return bool(await session.scalar(select(exists().where(_push_configs.c.run_id == run_id))))


async def push_configs_of(session: AsyncSession, run_id: str) -> list[PushConfigRecord]:
    """The run's configs, oldest first, read in the caller's transaction."""
    rows = await session.execute(
        select(_push_configs)
        .where(_push_configs.c.run_id == run_id)
        .order_by(_push_configs.c.created_at, _push_configs.c.id)
    )
    return [_record(row) for row in rows]


class PushConfigRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def create(self, owner: str, run_id: str, config: NewPushConfig) -> PushConfigRecord | None:
        """Store ``config`` for ``owner``'s run ``run_id``, replacing its config of the same id;
        None when ``owner`` has no such run (nothing stored); ``PushConfigLimitError`` when the
        run has ``MAX_PUSH_CONFIGS`` others. The caller checks the URL first
        (``app.webhooks.urls.UrlPolicy.check``)."""
        async with self._sessionmaker.begin() as session:
            # The run's row taken first (a no-op UPDATE): a run being closed at this moment either
            # sees the config or closed before it was stored, never half of it; and two configs
            # created at once are counted one after the other.
            owned = await session.execute(
                update(Run).where(Run.id == run_id, Run.owner == owner).values(attempt=Run.attempt)
            )
            if not owned.rowcount:  # type: ignore[attr-defined]
                return None
            others = await session.scalar(
                select(func.count())
                .select_from(_push_configs)
                .where(_push_configs.c.run_id == run_id, _push_configs.c.config_id != config.config_id)
            )
            if (others or 0) >= MAX_PUSH_CONFIGS:
                raise PushConfigLimitError()
            await insert_push_configs(session, run_id, owner, [config])
        return await self.get(owner, run_id, config.config_id)

    async def get(self, owner: str, run_id: str, config_id: str) -> PushConfigRecord | None:
        async with self._sessionmaker() as session:
            row = (
                await session.execute(
                    select(_push_configs).where(
                        _push_configs.c.run_id == run_id,
                        _push_configs.c.owner == owner,
                        _push_configs.c.config_id == config_id,
                    )
                )
            ).first()
        return _record(row) if row is not None else None

    async def list_configs(self, owner: str, run_id: str) -> list[PushConfigRecord]:
        """``owner``'s configs of the run, oldest first (none for another owner's run)."""
        async with self._sessionmaker() as session:
            rows = await session.execute(
                select(_push_configs)
                .where(_push_configs.c.run_id == run_id, _push_configs.c.owner == owner)
                .order_by(_push_configs.c.created_at, _push_configs.c.id)
            )
            return [_record(row) for row in rows]

    async def delete(self, owner: str, run_id: str, config_id: str) -> bool:
        """Remove ``owner``'s config of the run; False when there was none. Deliveries already
        owed for it are still made (they were owed when the change happened)."""
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                delete(_push_configs).where(
                    _push_configs.c.run_id == run_id,
                    _push_configs.c.owner == owner,
                    _push_configs.c.config_id == config_id,
                )
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]
