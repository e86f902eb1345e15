"""Database (engine and connection setup) against real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection

from app.db.repositories import ConversationRepo, RunRepo
from app.db.session import POSTGRES_POOL_SIZE, SQLITE_POOL_SIZE, Database, read_sessions
from tests.integration.conftest import PostgresServer, run_in_own_loop
from tests.support.server import async_wait_until


async def test_ping_is_true_on_a_reachable_database(database: Database) -> None:
    assert await database.ping() is True


async def test_ping_is_false_when_the_server_is_unreachable() -> None:
    # Port 1 on loopback: nothing listens there, so the connection is refused at once.
    db = Database("postgresql+asyncpg://postgres@127.0.0.1:1/nowhere")
    try:
        assert await db.ping(timeout_s=5) is False
    finally:
        await db.dispose()


async def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dirs" / "agentstream.db"
    db = Database(f"sqlite+aiosqlite:///{path}")
    try:
        async with db.engine.connect() as conn:
            journal = await conn.scalar(text("PRAGMA journal_mode"))
            busy = await conn.scalar(text("PRAGMA busy_timeout"))
            foreign_keys = await conn.scalar(text("PRAGMA foreign_keys"))
    finally:
        await db.dispose()

    assert (journal, busy, foreign_keys) == ("wal", 5000, 1)
    assert path.exists()


async def test_a_plain_sqlite_url_gets_the_async_driver(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'plain.db'}")
    try:
        assert db.engine.dialect.driver == "aiosqlite"
        assert await db.ping() is True
    finally:
        await db.dispose()


async def test_sqlite_pool_keeps_the_connections_a_peak_opened(tmp_path: Path) -> None:
    # As on PostgreSQL: an overflow connection was closed when given back and opened again at the
    # next peak (a thread started, the file opened, its pragmas set; bench/NOTES.md, eighth session).
    await _a_peak_stays_in_the_pool(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", SQLITE_POOL_SIZE - 2)


async def _a_peak_stays_in_the_pool(url: str, peak: int) -> None:
    """``peak`` connections at once, given back: all still in the pool after."""
    db = Database(url)
    held = []
    try:
        for _ in range(peak):
            held.append(await db.engine.connect())
        for conn in held:
            await conn.execute(text("SELECT 1"))
        while held:
            await held.pop().close()
        assert db.engine.pool.checkedin() == peak  # type: ignore[attr-defined]
    finally:
        for conn in held:
            await conn.close()
        await db.dispose()


async def test_reads_on_sqlite_are_the_plain_sessions(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'reads.db'}")
    try:
        assert read_sessions(db.sessionmaker) is db.sessionmaker  # sqlite3 begins nothing for a read
    finally:
        await db.dispose()


@pytest.mark.postgres
async def test_postgres_reads_of_one_statement_take_no_transaction(
    postgres_server: PostgresServer, postgres_migrated_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain session began a transaction at its first statement and rolled it back at its close:
    # two round trips for a read of one row (bench/NOTES.md, eighth session).
    db = Database(postgres_server.async_url(postgres_migrated_database))
    sent: list[str] = []
    real = asyncpg.Connection.execute

    async def counting(self: asyncpg.Connection, query: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(query.split()[0].rstrip(";").upper())  # BEGIN [ISOLATION LEVEL ...]
        return await real(self, query, *args, **kwargs)

    try:
        conversations, runs = ConversationRepo(db.sessionmaker), RunRepo(db.sessionmaker)
        conv = await conversations.create("owner", "a title", {})
        sent.clear()
        monkeypatch.setattr(asyncpg.Connection, "execute", counting)
        found = await conversations.get("owner", conv.id)
        assert found is not None and found.id == conv.id
        assert await conversations.get("someone else", conv.id) is None
        assert await runs.active(conv.id) is None
        assert sent == []  # no BEGIN, no ROLLBACK
        # The pool's connections still begin transactions for everything else.
        async with db.sessionmaker() as session:
            await session.execute(text("SELECT 1"))
        assert sent == ["BEGIN", "ROLLBACK"]
        sent.clear()
        await conversations.create("owner", "another", {})
        assert sent[0] == "BEGIN" and sent[-1] == "COMMIT"
    finally:
        await db.dispose()


@pytest.mark.postgres
async def test_postgres_pool_keeps_the_connections_a_peak_opened(
    postgres_server: PostgresServer, postgres_migrated_database: str
) -> None:
    # A connection opened for a peak and closed when given back is opened again at the next one:
    # a login and the statements prepared anew, on the event loop (bench/NOTES.md, seventh session).
    url = postgres_server.async_url(postgres_migrated_database)
    await _a_peak_stays_in_the_pool(url, POSTGRES_POOL_SIZE - 5)


@pytest.mark.postgres
async def test_postgres_pool_survives_the_server_closing_its_connections(
    postgres_server: PostgresServer, postgres_migrated_database: str
) -> None:
    # The session's own database: terminating its sessions disturbs no one else.
    database_name = postgres_migrated_database
    db = Database(postgres_server.async_url(database_name))
    try:
        assert await db.ping()

        async def terminate_every_session() -> int:
            conn = await asyncpg.connect(postgres_server.dsn(database_name))
            try:
                return int(
                    await conn.fetchval(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
            finally:
                await conn.close()

        assert run_in_own_loop(terminate_every_session) >= 1

        async def all_ended() -> bool:
            conn = await asyncpg.connect(postgres_server.dsn(database_name))
            try:
                left = await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                return int(left) == 0
            finally:
                await conn.close()

        # pg_terminate_backend only signals: the server has closed them once their processes are gone.
        await async_wait_until(all_ended, what="the terminated sessions to end")

        async with db.sessionmaker() as session:
            assert await session.scalar(text("SELECT 1")) == 1
    finally:
        await db.dispose()


@pytest.mark.postgres
async def test_postgres_checkout_pings_only_a_connection_the_server_spoke_on(
    postgres_server: PostgresServer, postgres_migrated_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings: list[object] = []
    real_ping = AsyncAdapt_asyncpg_connection.ping

    def counted_ping(self: AsyncAdapt_asyncpg_connection) -> None:
        pings.append(self)
        real_ping(self)

    monkeypatch.setattr(AsyncAdapt_asyncpg_connection, "ping", counted_ping)
    database_name = postgres_migrated_database
    db = Database(postgres_server.async_url(database_name))
    try:
        for _ in range(5):  # an idle, healthy connection: checked out without a round trip
            async with db.sessionmaker() as session:
                pid = await session.scalar(text("SELECT pg_backend_pid()"))
        assert pings == []

        # The server ends that backend: the connection has an error and EOF to read.
        async def terminate() -> bool:
            conn = await asyncpg.connect(postgres_server.dsn(database_name))
            try:
                return bool(await conn.fetchval("SELECT pg_terminate_backend($1)", pid))
            finally:
                await conn.close()

        assert run_in_own_loop(terminate)
        async with db.sessionmaker() as session:
            assert await session.scalar(text("SELECT pg_backend_pid()")) != pid
        # Replaced after one ping (or none, had the event loop already seen the connection close).
        assert len(pings) <= 1
    finally:
        await db.dispose()


@pytest.mark.postgres
async def test_a_postgres_statement_that_outlasts_the_command_timeout_fails_instead_of_waiting(
    postgres_server: PostgresServer, postgres_migrated_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What bounds the wait on a connection dropped without a reset: no answer within the timeout."""
    monkeypatch.setattr("app.db.session.POSTGRES_COMMAND_TIMEOUT_S", 0.3)
    db = Database(postgres_server.async_url(postgres_migrated_database))
    try:
        for sessionmaker in (db.sessionmaker, db.lease_sessionmaker):
            async with sessionmaker() as session:
                with pytest.raises(TimeoutError):
                    await session.execute(text("SELECT pg_sleep(5)"))
        async with db.sessionmaker() as session:
            assert await session.scalar(text("SELECT 1")) == 1  # the pool goes on
    finally:
        await db.dispose()


async def test_a_sqlite_write_transaction_starts_no_task_of_its_own(tmp_path: Path) -> None:
    """The write turn is held until the session is closed: closed in place, not in a task of its
    own (AsyncSession's shielded close), which cost the loop iterations while others waited."""
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'turn.db'}")
    loop = asyncio.get_running_loop()
    started: list[str] = []
    default = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        started.append(getattr(coro, "__qualname__", repr(coro)))
        if default is not None:
            return default(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        async with db.sessionmaker.begin() as session:
            await session.execute(text("CREATE TABLE t (v TEXT)"))
        loop.set_task_factory(counting)
        try:
            async with db.sessionmaker.begin() as session:
                await session.execute(text("INSERT INTO t VALUES ('a')"))
        finally:
            loop.set_task_factory(default)
        async with db.sessionmaker() as session:
            assert list(await session.scalars(text("SELECT v FROM t"))) == ["a"]
    finally:
        await db.dispose()

    assert started == []
