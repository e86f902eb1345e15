"""SQLite on the event loop's thread: statements are plain calls into ``sqlite3``, and only a wait
for another process's write lock goes to a thread.

With aiosqlite every statement, fetch, commit and pool reset is a trip to the connection's thread
and back through the event loop; under load each trip waits for the loop to come round (tens of
milliseconds at 100 streaming runs), and a process's write transactions take turns
(``WriteSerializingSessionmaker``), so the turn was held for tens of milliseconds for well under one
of database work and starts queued behind it (bench/NOTES.md, "Streaming cost against the floor").
SQLAlchemy's async adapter awaits the coroutines of ``InlineConnection``, which finish without
suspending, so a transaction holds the turn for its own CPU time and its commit.

A write transaction (``begin_immediate``) takes the file's write lock up front with
``BEGIN IMMEDIATE``, first without waiting (busy timeout 0); if another process holds it, it is
taken again on a thread that waits up to the busy timeout, so the loop never sleeps in SQLite's
busy handler. Once the lock is held nothing in a WAL database waits on another connection. The
commit runs on the loop: its fsync (``synchronous=FULL``) took about 1 ms a transaction under load,
where a trip to a thread and back cost a loop iteration, 15-20 ms. Reads in WAL mode take no lock.

``InlineConnection`` has the part of aiosqlite's ``Connection`` that SQLAlchemy's aiosqlite dialect
uses; ``inline_creator`` is the engine's ``async_creator`` (``app.db.session.create_engine``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

BEGIN_IMMEDIATE = "BEGIN IMMEDIATE"


class InlineCursor:
    """An aiosqlite-shaped cursor over a ``sqlite3`` cursor; every method returns at once."""

    __slots__ = ("_connection", "_cursor")

    def __init__(self, connection: InlineConnection, cursor: sqlite3.Cursor) -> None:
        self._connection = connection
        self._cursor = cursor

    async def __aenter__(self) -> InlineCursor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self._cursor.close()

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value

    async def execute(self, sql: str, parameters: Any = None) -> InlineCursor:
        if sql == BEGIN_IMMEDIATE:
            await self._connection.begin_immediate()
        elif parameters is None:
            self._cursor.execute(sql)
        else:
            self._cursor.execute(sql, parameters)
        return self

    async def executemany(self, sql: str, parameters: Iterable[Any]) -> InlineCursor:
        self._cursor.executemany(sql, parameters)
        return self

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(self._cursor.arraysize if size is None else size)

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def close(self) -> None:
        self._cursor.close()


class InlineConnection:
    """The part of aiosqlite's ``Connection`` that SQLAlchemy's aiosqlite dialect uses, run on the
    caller's thread except for a ``BEGIN IMMEDIATE`` that has to wait for another process."""

    def __init__(self, connection: sqlite3.Connection, busy_timeout_ms: int) -> None:
        self._connection: sqlite3.Connection | None = connection
        self._busy_timeout_ms = busy_timeout_ms

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._connection is None:
            raise ValueError("no active connection")
        return self._connection

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    def cursor(self) -> InlineCursor:
        return InlineCursor(self, self._conn.cursor())

    async def begin_immediate(self) -> None:
        conn = self._conn
        try:
            conn.execute(BEGIN_IMMEDIATE)  # busy timeout 0: fails at once if another process writes
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                raise
        waiting = asyncio.get_running_loop().run_in_executor(None, self._begin_waiting, conn)
        try:
            await asyncio.shield(waiting)
        except asyncio.CancelledError:
            # The thread cannot be stopped: wait it out, so that a lock it took goes with the
            # rollback of this transaction instead of staying with the pooled connection.
            while not waiting.done():
                try:
                    await asyncio.shield(waiting)
                except asyncio.CancelledError:
                    pass
            raise

    def _begin_waiting(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
        try:
            conn.execute(BEGIN_IMMEDIATE)
        finally:
            conn.execute("PRAGMA busy_timeout = 0")

    async def commit(self) -> None:
        self._conn.commit()

    async def rollback(self) -> None:
        self._conn.rollback()

    async def create_function(self, *args: Any, **kwargs: Any) -> None:
        self._conn.create_function(*args, **kwargs)

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.close()

    def stop(self) -> None:
        """aiosqlite's forced close, which SQLAlchemy's ``terminate()`` calls."""
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.close()


def inline_creator(path: Path, busy_timeout_ms: int) -> Callable[[], Awaitable[InlineConnection]]:
    """The ``async_creator`` of an engine whose connections are ``InlineConnection``s to ``path``,
    in autocommit mode: a write engine's ``begin`` event sends ``BEGIN IMMEDIATE``; a read takes
    a snapshot per statement, as with ``sqlite3``'s own transaction handling, which begins
    nothing before a ``SELECT``."""

    async def connect() -> InlineConnection:
        # check_same_thread off: a BEGIN that waits runs on a thread of the default executor.
        connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        return InlineConnection(connection, busy_timeout_ms)

    return connect


def executes(statements: Sequence[str]) -> Callable[[Any], None]:
    """A ``begin`` event listener that sends ``statements`` on the transaction's connection."""

    def listener(conn: Any) -> None:
        for statement in statements:
            conn.exec_driver_sql(statement)

    return listener
