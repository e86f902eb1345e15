"""Database fixtures for integration tests: every test gets an empty database of each dialect.

``database_url`` is parametrised over SQLite (a file under the test's tmp dir) and PostgreSQL (a
database named ``agentstream_test_<random>``, created for the test and dropped after it, so that
tests, and concurrent test sessions, never see each other's rows). The PostgreSQL server is the
one at ``AGENTSTREAM_TEST_POSTGRES`` (default ``postgresql://postgres@127.0.0.1:5432``); the admin
connection uses the database ``agentstream_test``, created if missing. ``database`` adds the
migrated schema and a ``Database`` handle on it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest

from app.db.migrate import upgrade_database
from app.db.session import Database

T = TypeVar("T")

ADMIN_DATABASE = "agentstream_test"


def run_in_own_loop(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion on a private loop in a private thread.

    Sync fixtures may run while pytest-asyncio owns the thread's event loop; a separate thread
    keeps the two from ever touching.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="db-fixture") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


@dataclass(frozen=True)
class PostgresServer:
    server_url: str  # postgresql://user@host:port, no database

    def dsn(self, database: str) -> str:
        return f"{self.server_url}/{database}"

    def async_url(self, database: str) -> str:
        return self.dsn(database).replace("postgresql://", "postgresql+asyncpg://", 1)

    def create_database(self, name: str) -> None:
        async def create() -> None:
            conn = await asyncpg.connect(self.dsn(ADMIN_DATABASE))
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()

        run_in_own_loop(create)

    def drop_database(self, name: str) -> None:
        async def drop() -> None:
            conn = await asyncpg.connect(self.dsn(ADMIN_DATABASE))
            try:
                # FORCE: a test that forgot to dispose its engine must not make teardown hang.
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await conn.close()

        run_in_own_loop(drop)


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    """The test PostgreSQL server, with the admin database ``agentstream_test`` present."""
    server = PostgresServer(
        os.environ.get("AGENTSTREAM_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432").rstrip("/")
    )

    async def ensure_admin_database() -> None:
        conn = await asyncpg.connect(server.dsn("postgres"), timeout=5)
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", ADMIN_DATABASE)
            if not exists:
                try:
                    await conn.execute(f'CREATE DATABASE "{ADMIN_DATABASE}"')
                except asyncpg.DuplicateDatabaseError:
                    pass  # another test session created it meanwhile
        finally:
            await conn.close()

    try:
        run_in_own_loop(ensure_admin_database)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"PostgreSQL not reachable at {server.server_url}: {exc}")
    return server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An async SQLAlchemy URL of an empty database, private to this test."""
    if request.param == "sqlite":
        # A missing parent directory on purpose: Database and migrations must create it.
        yield f"sqlite+aiosqlite:///{tmp_path / 'db' / 'agentstream.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = f"{ADMIN_DATABASE}_{secrets.token_hex(6)}"
    server.create_database(name)
    try:
        yield server.async_url(name)
    finally:
        server.drop_database(name)


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    """A ``Database`` on a freshly migrated schema (``alembic upgrade head``)."""
    await asyncio.to_thread(upgrade_database, database_url)
    db = Database(database_url)
    try:
        yield db
    finally:
        await db.dispose()
