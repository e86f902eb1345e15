"""SQLite on the event loop's thread (app.db.sqlite_inline) through ``Database``: a write
transaction runs without giving the loop up, waits on a thread (never on the loop) while another
process holds the file's write lock, and leaves no lock behind when cancelled during that wait."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import text

from app.db.session import Database
from app.db.sqlite_inline import InlineConnection

# Another process that takes the file's write lock, says so, and lets it go when told (stdin).
_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("INSERT INTO t VALUES ('other process')")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    path = tmp_path / "inline.db"
    database = Database(f"sqlite+aiosqlite:///{path}")
    async with database.sessionmaker.begin() as session:
        await session.execute(text("CREATE TABLE t (v TEXT)"))
    yield database
    await database.dispose()


@contextmanager
def write_lock_held_elsewhere(db: Database) -> Iterator[subprocess.Popen[str]]:
    path = db.engine.url.database
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=10)


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.write("go\n")
    holder.stdin.flush()


class Ticker:
    """Counts the event loop's iterations while it runs (a task that yields once an iteration)."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None
        self._waiters: list[tuple[int, asyncio.Event]] = []

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            for target, reached in self._waiters:
                if self.ticks >= target:
                    reached.set()
            await asyncio.sleep(0)

    async def more(self, n: int) -> None:
        """Return once the loop has gone round ``n`` more times."""
        reached = asyncio.Event()
        self._waiters.append((self.ticks + n, reached))
        await reached.wait()

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def values(db: Database) -> list[str]:
    async with db.sessionmaker() as session:
        return list(await session.scalars(text("SELECT v FROM t ORDER BY rowid")))


async def driver_connection(db: Database) -> object:
    async with db.sessionmaker.begin() as session:
        connection = await session.connection()
        raw = await connection.get_raw_connection()
        return raw.driver_connection


async def test_a_write_transaction_and_a_read_run_without_giving_the_loop_up(db: Database) -> None:
    async with Ticker() as ticker:
        before = ticker.ticks
        async with db.sessionmaker.begin() as session:
            await session.execute(text("INSERT INTO t VALUES ('a')"))
            await session.execute(text("INSERT INTO t VALUES ('b')"))
        read = await values(db)
        assert ticker.ticks == before  # no trip to a thread, no task of its own to close a session

    assert read == ["a", "b"]
    assert isinstance(await driver_connection(db), InlineConnection)


async def test_what_a_write_transaction_commits_is_on_disk_for_another_connection(db: Database) -> None:
    async with db.sessionmaker.begin() as session:
        await session.execute(text("INSERT INTO t VALUES ('kept')"))

    other = sqlite3.connect(str(db.engine.url.database))
    try:
        assert other.execute("SELECT v FROM t").fetchall() == [("kept",)]
    finally:
        other.close()


async def test_a_failed_write_transaction_leaves_nothing_and_the_next_one_works(db: Database) -> None:
    with pytest.raises(RuntimeError):
        async with db.sessionmaker.begin() as session:
            await session.execute(text("INSERT INTO t VALUES ('gone')"))
            raise RuntimeError("the caller failed")
    async with db.sessionmaker.begin() as session:
        await session.execute(text("INSERT INTO t VALUES ('next')"))

    assert await values(db) == ["next"]


async def test_a_write_waits_for_another_process_on_a_thread_while_the_loop_runs(db: Database) -> None:
    with write_lock_held_elsewhere(db) as holder:
        # Reads take no lock in WAL mode: answered at once, without the other process's row.
        assert await values(db) == []

        async def write() -> None:
            async with db.sessionmaker.begin() as session:
                await session.execute(text("INSERT INTO t VALUES ('after the other')"))

        async with Ticker() as ticker:
            writing = asyncio.create_task(write())
            async with asyncio.timeout(10):
                await ticker.more(50)  # the loop goes on while the write waits
            assert not writing.done()
            release(holder)
            async with asyncio.timeout(10):
                await writing

    assert await values(db) == ["other process", "after the other"]


async def test_a_write_cancelled_while_it_waits_for_the_lock_leaves_no_lock_behind(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = threading.Event()
    begin_waiting = InlineConnection._begin_waiting

    def observed(self: InlineConnection, conn: sqlite3.Connection) -> None:
        waiting.set()
        begin_waiting(self, conn)

    monkeypatch.setattr(InlineConnection, "_begin_waiting", observed)
    with write_lock_held_elsewhere(db) as holder:

        async def write() -> None:
            async with db.sessionmaker.begin() as session:
                await session.execute(text("INSERT INTO t VALUES ('cancelled')"))

        writing = asyncio.create_task(write())
        assert await asyncio.to_thread(waiting.wait, 10)  # the write waits for the lock on a thread
        writing.cancel()
        release(holder)  # the thread takes the lock now, after the cancel
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await writing

    # Nothing of the cancelled write, and the lock is free for this process and for another.
    async with db.sessionmaker.begin() as session:
        await session.execute(text("INSERT INTO t VALUES ('next')"))
    other = sqlite3.connect(str(db.engine.url.database), timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert await values(db) == ["other process", "next"]
