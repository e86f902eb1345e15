"""The SQLite driver (app.db.sqlite_driver) under SQLAlchemy, on real SQLite files: one trip to the
connection's thread per statement, none for a commit or rollback with no transaction to end, and
everything else as SQLAlchemy's aiosqlite driver has it (rows, rowcount, lastrowid, errors,
transactions, a rollback that undoes)."""

from __future__ import annotations

import asyncio
import collections
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

from app.db import sqlite_driver
from app.db.session import Database

Trips = collections.Counter[str]


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> Trips:
    """Every trip to a connection's thread, by what it ran (``_run`` is one statement)."""
    counted: Trips = collections.Counter()
    real = sqlite_driver.Connection._execute

    async def counting(self: sqlite_driver.Connection, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        counted[getattr(fn, "__name__", repr(fn))] += 1
        return await real(self, fn, *args, **kw)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(sqlite_driver.Connection, "_execute", counting)
    return counted


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'driver.db'}")
    async with database.engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT UNIQUE, n INTEGER)"))
        await conn.execute(text("INSERT INTO t (name, n) VALUES ('a', 1), ('b', 2), ('c', 3)"))
    yield database
    await database.dispose()


async def test_the_engine_runs_on_this_driver(db: Database) -> None:
    async with db.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        assert type(raw.driver_connection) is sqlite_driver.Connection


async def test_a_read_session_is_one_trip_a_statement_and_none_to_end(db: Database, trips: Trips) -> None:
    # Warm the pool first: opening a connection is a trip of its own.
    async with db.sessionmaker() as session:
        await session.execute(text("SELECT 1"))
    trips.clear()
    async with db.sessionmaker() as session:
        rows = (await session.execute(text("SELECT name, n FROM t ORDER BY id"))).all()
        count = await session.scalar(text("SELECT count(*) FROM t"))
    assert [tuple(r) for r in rows] == [("a", 1), ("b", 2), ("c", 3)]
    assert count == 3
    # aiosqlite's own cursor: cursor, execute, fetchall, close per statement, and two rollbacks.
    assert trips == {"_run": 2}


async def test_a_write_commits_in_one_trip_and_is_seen_by_another_connection(
    db: Database, trips: Trips
) -> None:
    async with db.sessionmaker.begin() as session:
        await session.execute(text("INSERT INTO t (name, n) VALUES ('d', 4)"))
        await session.execute(text("UPDATE t SET n = n + 10 WHERE name = 'a'"))
    assert trips["_run"] == 2
    assert trips["commit"] == 1
    assert trips["rollback"] == 0
    # A connection of its own (not the pool's): the write is on disk.
    other = await sqlite_driver.connect(str(db.engine.url.database))
    try:
        cursor = await other.cursor().execute("SELECT name, n FROM t WHERE name IN ('a', 'd') ORDER BY name")
        assert await cursor.fetchall() == [("a", 11), ("d", 4)]
    finally:
        await other.close()


async def test_a_failed_write_is_rolled_back(db: Database, trips: Trips) -> None:
    with pytest.raises(IntegrityError):
        async with db.sessionmaker.begin() as session:
            await session.execute(text("UPDATE t SET n = 100 WHERE name = 'b'"))
            await session.execute(text("INSERT INTO t (name, n) VALUES ('a', 9)"))  # name is unique
    assert trips["rollback"] == 1  # a transaction was open: its rollback is sent
    async with db.sessionmaker() as session:
        assert await session.scalar(text("SELECT n FROM t WHERE name = 'b'")) == 2
        # The connection is usable after the error.
        assert await session.scalar(text("SELECT count(*) FROM t")) == 3


async def test_rowcount_lastrowid_executemany_and_fetches(db: Database) -> None:
    async with db.engine.begin() as conn:
        updated = await conn.execute(text("UPDATE t SET n = n * 2 WHERE n >= 2"))
        assert updated.rowcount == 2
        inserted = await conn.execute(
            text("INSERT INTO t (name, n) VALUES (:name, :n)"), [{"name": f"x{i}", "n": i} for i in range(5)]
        )
        assert inserted.rowcount == 5
        single = await conn.execute(text("INSERT INTO t (name, n) VALUES ('y', 0)"))
        assert single.lastrowid == 9
        returned = await conn.execute(text("UPDATE t SET n = 0 WHERE name LIKE 'x%' RETURNING name"))
        assert sorted(r[0] for r in returned) == [f"x{i}" for i in range(5)]

        raw = (await conn.get_raw_connection()).driver_connection
        cursor = raw.cursor()
        await cursor.execute("SELECT id FROM t WHERE id <= ? ORDER BY id", (4,))
        assert await cursor.fetchone() == (1,)
        assert await cursor.fetchmany(2) == [(2,), (3,)]
        assert await cursor.fetchall() == [(4,)]
        assert await cursor.fetchone() is None
        assert await cursor.fetchall() == []


async def test_errors_are_sqlalchemys_and_leave_the_connection_usable(db: Database) -> None:
    async with db.engine.connect() as conn:
        with pytest.raises(OperationalError, match="no such table"):
            await conn.execute(text("SELECT * FROM missing"))
        await conn.rollback()
        assert await conn.scalar(text("SELECT count(*) FROM t")) == 3


async def test_an_in_memory_database_works_too() -> None:
    # sqlite3's thread check stays on for :memory: (SQLAlchemy's StaticPool keeps one connection).
    database = Database("sqlite+aiosqlite://")
    try:
        async with database.sessionmaker.begin() as session:
            await session.execute(text("CREATE TABLE m (v INTEGER)"))
            await session.execute(text("INSERT INTO m VALUES (1), (2)"))
        async with database.sessionmaker() as session:
            assert await session.scalar(text("SELECT sum(v) FROM m")) == 3
    finally:
        await database.dispose()


async def test_a_rollback_behind_a_cancelled_statement_still_ends_its_transaction(db: Database) -> None:
    # A statement whose caller was cancelled still runs in the connection's thread, after what is
    # queued before it. A rollback sent meanwhile must wait behind it, not judge by the
    # transaction it cannot see yet (sqlite3 opens it when the INSERT runs).
    connection = await sqlite_driver.connect(str(db.engine.url.database))
    gate = threading.Event()
    try:
        blocked = asyncio.ensure_future(connection._execute(gate.wait, 10))
        insert = asyncio.ensure_future(connection.cursor().execute("INSERT INTO t (name, n) VALUES ('z', 0)"))
        await asyncio.sleep(0)  # both tasks take their first step: both calls are queued
        assert connection._sent - connection._done == 2
        insert.cancel()
        rollback = asyncio.ensure_future(connection.rollback())
        await asyncio.sleep(0)  # the rollback takes its first step: it is queued behind the two
        assert connection._sent - connection._done == 3
        gate.set()
        assert await blocked is True
        await rollback
        assert not connection.in_transaction
        cursor = await connection.cursor().execute("SELECT count(*) FROM t WHERE name = 'z'")
        assert await cursor.fetchall() == [(0,)]
    finally:
        gate.set()
        await connection.close()


async def test_a_failed_statement_leaves_nothing_of_the_one_before(db: Database) -> None:
    connection = await sqlite_driver.connect(str(db.engine.url.database))
    try:
        cursor = await connection.cursor().execute("SELECT name FROM t ORDER BY id")
        with pytest.raises(sqlite3.OperationalError):
            await cursor.execute("SELECT * FROM missing")
        assert cursor.description is None
        assert await cursor.fetchall() == []
        # Iterated as a server-side cursor would be.
        await cursor.execute("SELECT n FROM t ORDER BY id")
        assert [row async for row in cursor] == [(1,), (2,), (3,)]
    finally:
        await connection.close()


async def test_a_closed_connection_refuses_a_commit_and_a_rollback(db: Database) -> None:
    connection = await sqlite_driver.connect(str(db.engine.url.database))
    await connection.close()
    with pytest.raises(ValueError, match=r"no active connection|closed"):
        await connection.rollback()
    with pytest.raises(ValueError, match=r"no active connection|closed"):
        await connection.commit()
