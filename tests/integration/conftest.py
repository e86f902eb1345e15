"""Database fixtures for integration tests: every test runs once on SQLite and once on PostgreSQL.

- ``database_url``: an empty database private to the test.
- ``migrated_database_url``: a database at ``alembic upgrade head`` with empty tables, cheap: a
  copy of a SQLite file migrated once per session; on PostgreSQL one database per session,
  migrated once, its rows deleted before each test (so never change its schema in a test).
- ``database``: a ``Database`` on ``migrated_database_url``, disposed after the test.

SQLite databases are files under the test's tmp dir. PostgreSQL ones are databases named
``agentstream_test_<random>``, dropped at the end, so that concurrent test sessions never see each
other's rows. The server is ``AGENTSTREAM_TEST_POSTGRES``
(default ``postgresql://postgres@127.0.0.1:5432``); the admin connection uses the database
``agentstream_test``, created if missing. PostgreSQL tests carry ``pytest.mark.postgres``
(``-m "not postgres"`` leaves them out) and are skipped if the server cannot be reached.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest

from app.db.migrate import upgrade_database
from app.db.models import Base
from app.db.session import Database

T = TypeVar("T")

ADMIN_DATABASE = "agentstream_test"


def run_in_thread(call: Callable[[], T]) -> T:
    """Run ``call`` in a private thread and return its result.

    Sync fixtures may run while pytest-asyncio owns this thread's event loop; anything that runs
    its own loop (``asyncio.run``, Alembic's async env) goes to a separate thread so that the two
    never touch.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="db-fixture") as pool:
        return pool.submit(call).result()


def run_in_own_loop(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return run_in_thread(lambda: asyncio.run(make()))


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

    def empty_tables(self, name: str) -> None:
        """Delete every row of the app's tables (not alembic_version) in database ``name``."""
        # DELETE, not TRUNCATE: on small tables it is a millisecond, TRUNCATE tens of them.
        statements = "; ".join(
            f'DELETE FROM "{table.name}"' for table in reversed(Base.metadata.sorted_tables)
        )

        async def empty() -> None:
            conn = await asyncpg.connect(self.dsn(name))
            try:
                await conn.execute("SET lock_timeout = '2s'")
                try:
                    await conn.execute(statements)
                except asyncpg.LockNotAvailableError:
                    # A previous test left a transaction open: end its session, then clean up.
                    await conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                    await conn.execute(statements)
            finally:
                await conn.close()

        run_in_own_loop(empty)


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


@pytest.fixture(scope="session")
def postgres_migrated_database(postgres_server: PostgresServer) -> Iterator[str]:
    """A database migrated once per session and emptied before each test that uses it."""
    name = f"{ADMIN_DATABASE}_{secrets.token_hex(6)}"
    postgres_server.create_database(name)
    try:
        run_in_thread(lambda: upgrade_database(postgres_server.async_url(name)))
        yield name
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(scope="session")
def sqlite_migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated once per session; tests get copies of it."""
    path = tmp_path_factory.mktemp("sqlite-template") / "agentstream.db"
    run_in_thread(lambda: upgrade_database(f"sqlite+aiosqlite:///{path}"))
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_backend(request: pytest.FixtureRequest) -> str:
    """Which database a test runs on; every database fixture below follows it."""
    return str(request.param)


def _sqlite_path(tmp_path: Path) -> Path:
    # A missing parent directory on purpose: Database and migrations must create it.
    return tmp_path / "db" / "agentstream.db"


@pytest.fixture
def database_url(database_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An async SQLAlchemy URL of an empty database, private to this test."""
    if database_backend == "sqlite":
        yield f"sqlite+aiosqlite:///{_sqlite_path(tmp_path)}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = f"{ADMIN_DATABASE}_{secrets.token_hex(6)}"
    server.create_database(name)
    try:
        yield server.async_url(name)
    finally:
        server.drop_database(name)


@pytest.fixture
def migrated_database_url(
    database_backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[str]:
    """A database at ``alembic upgrade head`` with empty tables, for this test alone.

    Do not change its schema (use ``database_url`` for that): on PostgreSQL it is one database per
    session, migrated once and emptied before each test.
    """
    if database_backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_migrated_template")
        path = _sqlite_path(tmp_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        yield f"sqlite+aiosqlite:///{path}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name: str = request.getfixturevalue("postgres_migrated_database")
    server.empty_tables(name)
    yield server.async_url(name)


@pytest.fixture
async def database(migrated_database_url: str) -> AsyncIterator[Database]:
    """A ``Database`` on a migrated schema, disposed after the test."""
    db = Database(migrated_database_url)
    try:
        yield db
    finally:
        await db.dispose()
