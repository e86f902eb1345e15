"""SQLite under SQLAlchemy with one trip to the connection's thread per statement.

aiosqlite runs each SQLite connection in a thread of its own, and every call is a trip there and
back: the call queued, the thread woken, its answer handed to the event loop. Through aiosqlite's
own cursor SQLAlchemy makes four of them per statement (make the cursor, execute, fetch the rows,
close it) and two more for each session that did not write (the session's rollback and the pool's,
each a trip for nothing). A run's reads and writes came to about 70 trips (bench/NOTES.md, seventh
session), and on a busy worker each is also a turn of the event loop to wait for.

``connect`` gives SQLAlchemy the same connection with two differences, neither visible to it:

- a cursor runs each statement in one trip: it makes a SQLite cursor, executes, reads every row it
  returns, notes ``description``, ``rowcount`` and ``lastrowid``, and closes it, all in the thread;
  the cursor SQLAlchemy holds serves the rows from memory. SQLAlchemy's own cursor for this driver
  reads every row at once too (``fetchall`` after each execute), so nothing is held longer; a
  server-side cursor (``stream()``, ``yield_per``, which the app does not use) gets its rows the
  same way, all at once.
- ``commit()`` and ``rollback()`` outside a transaction are not sent. ``sqlite3`` does nothing
  then either (both look at ``sqlite3_get_autocommit`` first). Whether a transaction is open only
  changes by this connection's own calls, so it is read only while none is queued or running.

Built on aiosqlite's ``Connection`` and its ``_execute``/``_conn`` (pinned, pyproject.toml).
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Sequence
from typing import Any

import aiosqlite

ITER_CHUNK_SIZE = 64  # aiosqlite's default


class _Statement:
    """What one statement left: its rows and the cursor's attributes, read in the thread."""

    __slots__ = ("description", "lastrowid", "rowcount", "rows")

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.description = cursor.description
        self.rows: list[Any] = cursor.fetchall() if cursor.description is not None else []
        self.rowcount = cursor.rowcount
        self.lastrowid = cursor.lastrowid


def _run(connection: sqlite3.Connection, call: Callable[[sqlite3.Cursor], object]) -> _Statement:
    cursor = connection.cursor()
    try:
        call(cursor)
        return _Statement(cursor)
    finally:
        cursor.close()


class Cursor:
    """The cursor SQLAlchemy's aiosqlite adapter uses (execute, executemany, fetch*, description,
    rowcount, lastrowid, arraysize, close, ``async with``), one trip per statement."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._rows: list[Any] = []
        self._at = 0
        self.description: Any = None
        self.rowcount = -1
        self.lastrowid: int | None = None
        self.arraysize = 1

    def __await__(self) -> Generator[Any, None, Cursor]:
        return self
        yield  # a generator: awaiting the cursor hands it over without a trip

    async def __aenter__(self) -> Cursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _statement(self, call: Callable[[sqlite3.Cursor], object]) -> Cursor:
        # Nothing of the statement before (as sqlite3 has it), whatever becomes of this one.
        self._rows, self._at, self.description, self.rowcount, self.lastrowid = [], 0, None, -1, None
        connection = self._connection
        done: _Statement = await connection._execute(_run, connection._conn, call)
        self._rows, self._at = done.rows, 0
        self.description, self.rowcount, self.lastrowid = done.description, done.rowcount, done.lastrowid
        return self

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] | None = None) -> Cursor:
        if parameters is None:
            return await self._statement(lambda cursor: cursor.execute(sql))
        return await self._statement(lambda cursor: cursor.execute(sql, parameters))

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any] | dict[str, Any]]) -> Cursor:
        return await self._statement(lambda cursor: cursor.executemany(sql, parameters))

    async def executescript(self, script: str) -> Cursor:
        return await self._statement(lambda cursor: cursor.executescript(script))

    async def fetchone(self) -> Any:
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        start = self._at
        self._at = min(len(self._rows), start + (self.arraysize if size is None else size))
        return self._rows[start : self._at]

    async def fetchall(self) -> list[Any]:
        rows = self._rows[self._at :] if self._at else self._rows
        self._rows, self._at = [], 0
        return rows

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (row := await self.fetchone()) is not None:
            yield row

    async def close(self) -> None:
        self._rows, self._at = [], 0


class Connection(aiosqlite.Connection):
    """aiosqlite's connection with the cursor above and no trip for a commit or rollback that
    has no transaction to end.

    Whether a transaction is open is read only when no call of this connection is queued or
    running in its thread: a statement whose caller was cancelled still runs there, and may open
    one. A rollback then waits behind it, as every call does. (Calls put on aiosqlite's queue
    directly are not counted: SQLAlchemy's isolation level setter, which the app does not use, and
    ``stop()``, after which nothing is sent.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each counted by one thread only: sent by the event loop's, done by the connection's.
        self._sent = 0
        self._done = 0

    async def _execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self._done += 1

        if not self._running or not self._connection:
            raise ValueError("Connection closed")  # as aiosqlite refuses it, before it is queued
        self._sent += 1
        return await super()._execute(call)  # type: ignore[no-untyped-call]

    def _idle_outside_transaction(self) -> bool:
        return (
            self._running  # else the call is refused as aiosqlite refuses it
            and self._connection is not None
            and self._sent == self._done
            and not self._connection.in_transaction
        )

    def cursor(self) -> Cursor:  # type: ignore[override]
        return Cursor(self)

    async def commit(self) -> None:
        if not self._idle_outside_transaction():
            await super().commit()

    async def rollback(self) -> None:
        if not self._idle_outside_transaction():
            await super().rollback()


async def connect(database: str, **kwargs: Any) -> Connection:
    """Open ``database`` as ``aiosqlite.connect`` would (``kwargs`` go to ``sqlite3.connect``)."""
    connection = Connection(lambda: sqlite3.connect(database, **kwargs), ITER_CHUNK_SIZE)
    # As SQLAlchemy does with aiosqlite's own: a connection left open must not keep the
    # interpreter from exiting.
    connection._thread.daemon = True
    await connection
    return connection
