"""SQLite under SQLAlchemy with one trip to the connection's thread per statement, and none for a
write transaction.

aiosqlite runs each SQLite connection in a thread of its own, and every call is a trip there and
back: the call queued, the thread woken, its answer handed to the event loop. Through aiosqlite's
own cursor SQLAlchemy makes four of them per statement (make the cursor, execute, fetch the rows,
close it) and two more for each session that did not write (the session's rollback and the pool's,
each a trip for nothing). A run's reads and writes came to 77 trips (bench/NOTES.md, seventh
session), and on a busy worker each is also a turn of the event loop to wait for.

``connect`` gives SQLAlchemy the same connection with three differences, none visible to it:

- a cursor runs each statement in one trip: it makes a SQLite cursor, executes, reads every row it
  returns, notes ``description``, ``rowcount`` and ``lastrowid``, and closes it, all in the thread;
  the cursor SQLAlchemy holds serves the rows from memory. SQLAlchemy's own cursor for this driver
  reads every row at once too (``fetchall`` after each execute), so nothing is held longer; a
  server-side cursor (``stream()``, ``yield_per``, which the app does not use) gets its rows the
  same way, all at once.
- ``commit()`` and ``rollback()`` outside a transaction are not sent. ``sqlite3`` does nothing
  then either (both look at ``sqlite3_get_autocommit`` first). Whether a transaction is open only
  changes by this connection's own calls, so it is read only while none is queued or running.
- a write transaction runs on the event loop's thread, without a trip, while the connection's
  thread is idle: its statements and its commit. A write transaction holds the process's write turn
  (``app.db.session.WriteSerializingSessionmaker``) and every other write waits for it: with a trip
  per statement it held the turn for a turn of a busy event loop per statement, and at the knee of
  one worker the turn was never free (a run's start held it for 28 ms, and starts waited 0.3-1.2 s
  for it: bench/NOTES.md, eighth session); now for the statements' own time. Its first write
  (INSERT, UPDATE, DELETE, REPLACE) runs here with SQLite's busy wait off: if another process holds
  the write lock it goes to the thread, to wait there (the busy timeout) instead of on the event
  loop. After it the connection holds the lock, and nothing of the transaction waits for another
  writer. An ``executemany`` of more than ``FEW_ROWS`` rows (a group commit's thousands of events)
  goes to the thread, where SQLite releases the GIL while it steps, and so does the commit of a
  transaction any of whose statements went there (it writes hundreds of pages to the log, and
  checkpoints it every thousand pages or so). Reads outside a transaction go to the thread too (they
  run beside the event loop, and hold no turn).

Built on aiosqlite's ``Connection`` and its ``_execute``/``_conn`` (pinned, pyproject.toml).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Sequence
from typing import Any, Literal

import aiosqlite

ITER_CHUNK_SIZE = 64  # aiosqlite's default
FEW_ROWS = 64
"""An ``executemany`` of at most this many rows runs as a statement does; more go to the thread."""
_WRITE = re.compile(r"\s*(INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)
"""A statement that takes SQLite's write lock (and that ``sqlite3`` begins a transaction for)."""


class _Statement:
    """What one statement left: its rows and the cursor's attributes, read in the thread."""

    __slots__ = ("description", "in_transaction", "lastrowid", "rowcount", "rows")

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.description = cursor.description
        self.rows: list[Any] = cursor.fetchall() if cursor.description is not None else []
        self.rowcount = cursor.rowcount  # -1 unless it was a write (INSERT, UPDATE, DELETE, REPLACE)
        self.lastrowid = cursor.lastrowid
        self.in_transaction = cursor.connection.in_transaction


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

    async def _statement(
        self, call: Callable[[sqlite3.Cursor], object], *, here: bool | Literal["write"] = True
    ) -> Cursor:
        """Run ``call`` on a SQLite cursor: here, on the event loop's thread, if ``here`` and the
        connection holds the write lock, or if it is a write (``"write"``) that gets the lock at
        once; else in the connection's thread."""
        # Nothing of the statement before (as sqlite3 has it), whatever becomes of this one.
        self._rows, self._at, self.description, self.rowcount, self.lastrowid = [], 0, None, -1, None
        connection = self._connection
        done: _Statement | None = None
        if here and connection._holds_write_lock():
            try:
                done = _run(connection._conn, call)
            except BaseException:
                connection._writing = False  # the rest of the transaction through the thread
                raise
        elif here == "write" and connection._idle():
            done = connection._try_first_write(call)
        if done is None:
            done = await connection._execute(_run, connection._conn, call)
            connection._sent_away = done.in_transaction
        connection._wrote(done)
        self._rows, self._at = done.rows, 0
        self.description, self.rowcount, self.lastrowid = done.description, done.rowcount, done.lastrowid
        return self

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] | None = None) -> Cursor:
        here: bool | Literal["write"] = "write" if _WRITE.match(sql) else True
        if parameters is None:
            return await self._statement(lambda cursor: cursor.execute(sql), here=here)
        return await self._statement(lambda cursor: cursor.execute(sql, parameters), here=here)

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any] | dict[str, Any]]) -> Cursor:
        # A few rows (a run's done, its messages) as a statement; a group commit's in the thread.
        few = isinstance(parameters, list | tuple) and len(parameters) <= FEW_ROWS
        here: bool | Literal["write"] = ("write" if _WRITE.match(sql) else True) if few else False
        return await self._statement(lambda cursor: cursor.executemany(sql, parameters), here=here)

    async def executescript(self, script: str) -> Cursor:
        return await self._statement(lambda cursor: cursor.executescript(script), here=False)

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
    """aiosqlite's connection with the cursor above, no trip for a commit or rollback that has no
    transaction to end, and a write transaction's statements after its first write run here.

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
        self._writing = False
        """A write of the open transaction succeeded: this connection holds SQLite's write lock."""
        self._sent_away = False
        """A statement of the open transaction went to the thread (many rows, or a wait for the
        lock): its commit goes there too."""
        self._busy_timeout_ms: int | None = None
        """The connection's busy timeout, read once (at its first write here) to be put back."""

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

    def _idle(self) -> bool:
        """Whether the connection is open and its thread idle: no call queued or running, not even
        a cancelled caller's. Only then may the event loop's thread use it."""
        return self._running and self._connection is not None and self._sent == self._done

    def _holds_write_lock(self) -> bool:
        """Whether a statement may run here, now: the connection holds the write lock, and its
        thread is idle."""
        if not self._writing or not self._idle():
            return False
        if not self._conn.in_transaction:
            self._writing = False  # the transaction ended without our commit or rollback
            return False
        return True

    def _try_first_write(self, call: Callable[[sqlite3.Cursor], object]) -> _Statement | None:
        """Run a write here if it gets the write lock without waiting; None if another process
        holds it (the caller sends it to the thread, which waits for it)."""
        connection = self._conn
        if self._busy_timeout_ms is None:
            self._busy_timeout_ms = int(connection.execute("PRAGMA busy_timeout").fetchone()[0])
        connection.execute("PRAGMA busy_timeout = 0")
        try:
            return _run(connection, call)
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY:  # BUSY_SNAPSHOT and the rest: as they are
                raise
            return None  # (a deferred transaction may have begun: the thread's attempt goes on in it)
        finally:
            connection.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")

    def _wrote(self, done: _Statement) -> None:
        if not done.in_transaction:
            self._writing = self._sent_away = False
        elif done.rowcount >= 0:  # a write, in a transaction, that succeeded: the lock is held
            self._writing = True

    def cursor(self) -> Cursor:  # type: ignore[override]
        return Cursor(self)

    async def commit(self) -> None:
        if self._holds_write_lock() and not self._sent_away:
            self._writing = False
            self._conn.commit()  # here too: see the module's docstring
            return
        self._writing = self._sent_away = False
        if not self._idle_outside_transaction():
            await super().commit()

    async def rollback(self) -> None:
        self._writing = self._sent_away = False
        if not self._idle_outside_transaction():
            await super().rollback()


async def connect(database: str, **kwargs: Any) -> Connection:
    """Open ``database`` as ``aiosqlite.connect`` would (``kwargs`` go to ``sqlite3.connect``)."""
    # Used from the event loop's thread too (a write transaction's statements, only while its own
    # thread is idle); SQLite itself is built serialized.
    kwargs["check_same_thread"] = False
    connection = Connection(lambda: sqlite3.connect(database, **kwargs), ITER_CHUNK_SIZE)
    # As SQLAlchemy does with aiosqlite's own: a connection left open must not keep the
    # interpreter from exiting.
    connection._thread.daemon = True
    await connection
    return connection
