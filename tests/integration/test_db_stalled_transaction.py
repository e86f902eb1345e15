"""A worker that stalls inside a write transaction (a frozen process, a paused VM, a partition that
leaves its connection open) must not keep the other workers from carrying its runs on (RUNS.md
R-03). On PostgreSQL its transaction holds the run's row lock (a lease renewal, a fenced event save)
and a claim of the run waits for that lock: the server ends a worker's session left idle in a transaction
for longer than the run lease (``Database(stalled_transaction_s=...)``), and the lock with it."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import text, update
from sqlalchemy.exc import DBAPIError

from app.db.errors import database_unreachable
from app.db.models import Run, utcnow
from app.db.repositories import ConversationRepo, RunRepo
from app.db.session import Database, postgres_connect_args
from app.main import build_services, close_services
from app.settings import Settings
from tests.support.server import async_wait_until

LEASE_S = 1.0

postgres_only = pytest.mark.parametrize(
    "database_backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


@postgres_only
async def test_a_claim_does_not_wait_on_a_stalled_workers_transaction(migrated_database_url: str) -> None:
    stalled = Database(migrated_database_url, stalled_transaction_s=LEASE_S)
    other = Database(migrated_database_url)
    locked, wake = asyncio.Event(), asyncio.Event()
    try:
        conv = await ConversationRepo(stalled.sessionmaker).create("alice", "t", {})
        run, _ = await RunRepo(stalled.sessionmaker).start(
            conv.id, "alice", "q", worker_id="w-stalled", lease_s=LEASE_S, start_cursor="0-0"
        )

        async def stall_in_a_transaction() -> None:
            # A lease renewal (or the fence of an event save): the run's row locked, then the stall.
            async with stalled.sessionmaker.begin() as session:
                await session.execute(
                    update(Run)
                    .where(Run.id == run.id, Run.attempt == 1, Run.worker_id == "w-stalled")
                    .values(lease_expires_at=utcnow() + timedelta(hours=1))
                )
                locked.set()
                await wake.wait()

        stuck = asyncio.create_task(stall_in_a_transaction())
        await asyncio.wait_for(locked.wait(), timeout=5)
        runs = RunRepo(other.sessionmaker)
        free = await async_wait_until(
            lambda: runs.claimable("w-other"),
            within=5 * LEASE_S,
            what="the stalled worker's lease to run out",
        )
        assert [r.id for r in free] == [run.id], "the lease should have run out"

        claimed = await asyncio.wait_for(runs.claim(free[0], "w-other", 30.0, lost=True), timeout=5 * LEASE_S)

        assert claimed is not None and (claimed.attempt, claimed.worker_id) == (2, "w-other")
        # Awake again, the stalled worker's transaction is gone: nothing of it lands.
        wake.set()
        with pytest.raises(DBAPIError) as ended:
            await asyncio.wait_for(stuck, timeout=5)
        assert database_unreachable(ended.value), ended.value
        after = await RunRepo(other.sessionmaker).get_any(run.id)
        assert after is not None and (after.attempt, after.worker_id) == (2, "w-other")
        assert after.lease_expires_at is not None
        assert after.lease_expires_at < utcnow() + timedelta(seconds=60), "the stalled renewal landed"
    finally:
        wake.set()
        await stalled.dispose()
        await other.dispose()


@postgres_only
async def test_both_pools_of_a_worker_ask_the_server_to_end_a_transaction_left_idle(
    migrated_database_url: str,
) -> None:
    db = Database(migrated_database_url, stalled_transaction_s=2.5)
    plain = Database(migrated_database_url)
    try:
        for sessions in (db.sessionmaker, db.lease_sessionmaker):
            async with sessions() as session:
                shown = await session.scalar(text("SHOW idle_in_transaction_session_timeout"))
            assert shown == "2500ms"
        async with plain.sessionmaker() as session:
            assert await session.scalar(text("SHOW idle_in_transaction_session_timeout")) != "2500ms"
    finally:
        await db.dispose()
        await plain.dispose()


@postgres_only
async def test_a_worker_gives_its_database_the_run_lease_as_the_bound(migrated_database_url: str) -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, database_url=migrated_database_url, run_lease_s=7.25, log_level="WARNING"
    )
    services = await build_services(settings)
    try:
        for sessions in (services.db.sessionmaker, services.db.lease_sessionmaker):
            async with sessions() as session:
                assert await session.scalar(text("SHOW idle_in_transaction_session_timeout")) == "7250ms"
    finally:
        await close_services(services)


@pytest.mark.parametrize(
    ("lease_s", "sent"), [(30.0, "30000"), (0.2, "1000"), (2.0001, "2001"), (1e9, str(2**31 - 1))]
)
def test_the_bound_is_the_lease_in_milliseconds_at_least_a_second_and_what_the_server_takes(
    lease_s: float, sent: str
) -> None:
    assert postgres_connect_args(lease_s)["server_settings"] == {"idle_in_transaction_session_timeout": sent}
    assert "server_settings" not in postgres_connect_args()
