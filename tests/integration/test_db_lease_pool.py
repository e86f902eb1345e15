"""A worker whose requests hold every pooled connection is alive: its heartbeat must still renew."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from app.db.repositories import ConversationRepo, RunRepo
from app.db.session import Database


@pytest.mark.parametrize(
    "database_backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_lease_renewal_does_not_wait_for_the_busy_request_pool(migrated_database_url: str) -> None:
    db = Database(migrated_database_url)
    try:
        conv = await ConversationRepo(db.sessionmaker).create("alice", "t", {})
        run, _ = await RunRepo(db.sessionmaker).start(
            conv.id, "alice", "q", worker_id="w1", lease_s=1.0, start_cursor="0-0"
        )
        pool = db.engine.pool
        async with AsyncExitStack() as held:
            # Take every connection the request pool will give (its size plus its overflow).
            for _ in range(pool.size() + db.engine.pool._max_overflow):  # type: ignore[attr-defined]
                await held.enter_async_context(db.engine.connect())
            leases = RunRepo(db.lease_sessionmaker)
            await asyncio.wait_for(leases.renew_leases([run.id], "w1", 30.0), timeout=5)
            mine = await asyncio.wait_for(leases.running_of_worker("w1"), timeout=5)
        assert [r.id for r in mine] == [run.id]
        assert await RunRepo(db.sessionmaker).claimable("w") == []
    finally:
        await db.dispose()
