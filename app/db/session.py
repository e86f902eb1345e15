"""The database handle: the async engine, its session factory, and the per-dialect connection setup.

SQLite gets WAL (readers never block the writer), a 5 s busy timeout (several workers on one host
may share the file) and enforced foreign keys; PostgreSQL gets a liveness check at every checkout so
that a restarted server does not fail the first query of every pooled connection (``_check_alive``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import select
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import Pool

from app.db import sqlite_driver

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 5000
SQLITE_POOL_SIZE = 15
"""Connections a worker's pool holds on a SQLite file (a thread each), all kept once opened."""

POSTGRES_POOL_SIZE = 30
"""Connections a worker's request pool holds on PostgreSQL, all kept once opened (no overflow)."""

POSTGRES_COMMAND_TIMEOUT_S = 60.0
"""Longest a PostgreSQL statement may take. Bounds the wait on a connection that a firewall or NAT
dropped without a word (no reset): otherwise a write would hang until TCP gives up, about 15
minutes, and with it every run's event saves, which share one writer."""

# Drivers people write in DATABASE_URL out of habit, mapped to the async driver we ship.
_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgresql+psycopg2": "postgresql+asyncpg",
}


def async_database_url(url: str | URL) -> URL:
    """``url`` with its driver replaced by the async one (``postgres://`` -> ``postgresql+asyncpg://``)."""
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    return parsed.set(drivername=driver) if driver else parsed


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or url.query.get("uri") or database.startswith("file:"):
        return None
    return Path(database)


def create_engine(
    url: str | URL,
    *,
    enforce_foreign_keys: bool = True,
    poolclass: type[Pool] | None = None,
    stalled_transaction_s: float | None = None,
) -> AsyncEngine:
    """An async engine for ``url`` set up for its dialect.

    ``enforce_foreign_keys=False`` is for migrations only: SQLite batch migrations rebuild a table
    by dropping it, and with foreign keys on that drop would cascade-delete the child rows.
    ``stalled_transaction_s``: on PostgreSQL, the server ends a session of this engine that sits
    idle inside a transaction for longer (``postgres_connect_args``).
    """
    parsed = async_database_url(url)
    kwargs: dict[str, Any] = {}
    if poolclass is not None:
        kwargs["poolclass"] = poolclass
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        # The file and the arguments as SQLAlchemy makes them for this URL, opened by our driver
        # (app.db.sqlite_driver: one trip to the connection's thread per statement).
        args, params = parsed.get_dialect()().create_connect_args(parsed)
        if path is not None and poolclass is None:
            # The most SQLAlchemy's default allows (5 + 10 overflow), all kept: an overflow
            # connection was closed when given back and opened at the next peak (a thread started,
            # the file opened, the pragmas and SQLAlchemy's functions set up): 0.77 opened a run
            # at 50 runs at a time (bench/NOTES.md, eighth session).
            kwargs.update(pool_size=SQLITE_POOL_SIZE, max_overflow=0)
        engine = create_async_engine(
            parsed, async_creator=partial(sqlite_driver.connect, *args, **params), **kwargs
        )
        _configure_sqlite(engine, enforce_foreign_keys=enforce_foreign_keys)
        return engine
    if parsed.get_backend_name() == "postgresql":
        if poolclass is None:
            # Every active run and open stream borrows connections briefly; SQLAlchemy's default
            # 5 + 10 ran dry at 200 concurrent conversations a worker (docs/reliability.md). All 30
            # are kept once opened: as 10 + 20 overflow, a connection past the tenth was closed
            # when given back and opened anew at the next peak (a TLS attempt, a login and the
            # statements prepared again, on the event loop): at 200 streaming runs the loop lagged
            # and token delivery p50 / p99 were 84-99 / 149-172 ms, against 34-35 / 88-96 ms with the
            # same 30 kept (bench/NOTES.md, seventh session).
            kwargs.update(pool_size=POSTGRES_POOL_SIZE, max_overflow=0)
        kwargs["connect_args"] = postgres_connect_args(stalled_transaction_s)
        engine = create_async_engine(parsed, **kwargs)
        event.listen(engine.sync_engine, "checkout", _check_alive)
        return engine
    return create_async_engine(parsed, **kwargs)


POSTGRES_MAX_TIMEOUT_MS = 2**31 - 1
"""The largest value PostgreSQL takes for a timeout setting (about 24.8 days)."""


def postgres_connect_args(stalled_transaction_s: float | None = None) -> dict[str, Any]:
    """asyncpg's arguments. With ``stalled_transaction_s``, the server ends the session of a
    transaction left idle between statements for longer (``idle_in_transaction_session_timeout``,
    sent at connect; at least 1 s).

    A worker that stalls inside a write transaction (its process frozen, its host paused, a
    partition that leaves its connection open) keeps that transaction's row locks. Several lock
    their run's row: a lease renewal, a fenced event save, a run's close or park, an approval's
    decision. A claim of the run waits for that lock, as long as the stall lasts, where the run's
    lease says it may be carried on (RUNS.md R-03). Given the run lease, a transaction idle that
    long is a dead worker's: ending it frees its locks, and what it held back never commits. A
    worker's transactions wait on nothing but their own statements. (A stall in the middle of
    sending one statement, such as a batch insert of more than asyncpg's 128 KB chunk, is not
    idle to the server: the claim then waits for the claimer's ``command_timeout``.)"""
    args: dict[str, Any] = {"command_timeout": POSTGRES_COMMAND_TIMEOUT_S}
    if stalled_transaction_s is not None:
        ms = min(POSTGRES_MAX_TIMEOUT_MS, max(1000, math.ceil(stalled_transaction_s * 1000)))
        args["server_settings"] = {"idle_in_transaction_session_timeout": str(ms)}
    return args


def _pending_input(driver_connection: Any) -> bool:
    """Whether the server sent anything (or closed) since the connection went idle; True if unknown.

    An idle PostgreSQL connection receives nothing unless the server is closing it (terminated,
    restarted: an error message, then EOF) or has news for it (a notice, a parameter change). One
    ``poll()`` of its socket tells, with no round trip to the server.
    """
    transport = getattr(driver_connection, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _check_alive(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Pool checkout: hand out only a live connection (SQLAlchemy replaces one that raises this).

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip each time, which was about
    a quarter of a run's database CPU (bench/db_bench.py) and, on a busy event loop, a wait for the
    loop each time. Here a connection is pinged only when its socket has something to read (the
    server closing it, mostly); one that the event loop already saw closed is replaced at once.
    """
    driver = dbapi_connection.driver_connection
    if driver.is_closed():
        raise DisconnectionError("the server closed this connection")
    if _pending_input(driver):
        try:
            dbapi_connection.ping()
        except Exception as exc:
            raise DisconnectionError(f"the connection failed its ping: {exc!r}") from exc


def _configure_sqlite(engine: AsyncEngine, *, enforce_foreign_keys: bool) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching to WAL needs a lock another worker may hold.
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute(f"PRAGMA foreign_keys = {'ON' if enforce_foreign_keys else 'OFF'}")
        finally:
            cursor.close()


def read_sessions(sessionmaker: async_sessionmaker[AsyncSession]) -> async_sessionmaker[AsyncSession]:
    """Sessions for reads of one statement. On a server database they open no transaction (the
    ``AUTOCOMMIT`` isolation level, on the same pool): a plain session sends BEGIN before its first
    statement and ROLLBACK at its close, two round trips and about a quarter of such a read's CPU on
    the event loop (bench/NOTES.md, eighth session). The server runs a statement sent alone as a
    transaction of its own, so it sees what it saw as the only statement of ours. On SQLite,
    ``sessionmaker`` itself: ``sqlite3`` begins no transaction for a read."""
    bind = sessionmaker.kw.get("bind")
    if not isinstance(bind, AsyncEngine) or bind.dialect.name == "sqlite":
        return sessionmaker
    return async_sessionmaker(
        bind.execution_options(isolation_level="AUTOCOMMIT"),
        expire_on_commit=sessionmaker.kw.get("expire_on_commit", True),
    )


class WriteSerializingSessionmaker(async_sessionmaker[AsyncSession]):
    """For SQLite: the write transactions (``begin()``) of one process take turns, first come first
    served, while reads (plain sessions) still run side by side.

    SQLite has one writer at a time. Left to contend, writers of one process wait for the file lock
    through the busy handler's sleeps, and under load some lose for longer than the busy timeout:
    at 200 concurrent runs on one worker, runs failed with "database is locked" (HTTP 500).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._write_turn = asyncio.Lock()

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncSession]:  # type: ignore[override]
        async with self._write_turn:
            # Not ``async with session``: AsyncSession closes itself in a task of its own, shielded
            # from cancellation, which costs the event loop two or three iterations (tens of
            # milliseconds under load) while the turn is held and every other write waits. By the
            # time it closes, the transaction is committed or rolled back, so a cancellation in
            # the close leaves no lock behind (SQLAlchemy then discards the connection).
            session = self()
            try:
                async with session.begin():
                    yield session
            finally:
                await session.close()


class Database:
    """One async engine and its session factory; build it in the app's lifespan, dispose it at the end."""

    def __init__(self, url: str, *, stalled_transaction_s: float | None = None) -> None:
        """``stalled_transaction_s``: the run lease, past which a transaction left idle is a
        stalled worker's and the server ends it (PostgreSQL; ``postgres_connect_args``)."""
        self.engine: AsyncEngine = create_engine(url, stalled_transaction_s=stalled_transaction_s)
        factory = WriteSerializingSessionmaker if self.engine.dialect.name == "sqlite" else async_sessionmaker
        self.sessionmaker: async_sessionmaker[AsyncSession] = factory(self.engine, expire_on_commit=False)
        # Lease renewal must not queue behind a busy pool: a worker whose requests exhaust the pool
        # is alive, and if its heartbeat waited for a connection the other workers would reap its
        # runs. A server database gets a small pool of its own for it; SQLite serializes writes in
        # the process anyway, so it shares the one engine.
        self._lease_engine: AsyncEngine | None = None
        self.lease_sessionmaker = self.sessionmaker
        if self.engine.dialect.name != "sqlite":
            self._lease_engine = create_async_engine(
                self.engine.url,
                pool_size=1,
                max_overflow=1,
                pool_pre_ping=True,
                connect_args=postgres_connect_args(stalled_transaction_s),
            )
            self.lease_sessionmaker = async_sessionmaker(self._lease_engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def ping(self, timeout_s: float = 5.0) -> bool:
        """True if a ``SELECT 1`` succeeds within ``timeout_s``; never raises (readiness probe)."""
        try:
            async with asyncio.timeout(timeout_s), self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        # Any failure at all means "not ready": drivers raise OSError, their own errors or
        # SQLAlchemy's wrappers depending on where the connection broke.
        except Exception as exc:
            log.warning("database ping failed error=%s", type(exc).__name__)
            return False
        return True

    async def dispose(self) -> None:
        await self.engine.dispose()
        if self._lease_engine is not None:
            await self._lease_engine.dispose()
