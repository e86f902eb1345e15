"""``transaction()`` on the database's transaction thread (app.db.session.TransactionThread), on a
SQLite file: outcomes, rollback, cancellation, closing, and the write turn shared with ``begin()``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.session import Database, transaction


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[Database]:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 't.db'}")
    async with db.sessionmaker.begin() as session:
        await session.execute(text("CREATE TABLE t (v INTEGER NOT NULL)"))
    try:
        yield db
    finally:
        await db.dispose()


async def values(db: Database) -> list[int]:
    async with db.sessionmaker() as session:
        return [row[0] for row in await session.execute(text("SELECT v FROM t ORDER BY rowid"))]


async def test_a_transaction_runs_on_the_thread_and_commits_with_its_result(database: Database) -> None:
    threads: list[str] = []

    async def work(session: AsyncSession) -> int:
        threads.append(threading.current_thread().name)
        await session.execute(text("INSERT INTO t VALUES (1)"))
        return 7

    assert await transaction(database.sessionmaker, work) == 7
    assert threads == ["db-transactions"]
    assert await values(database) == [1]


async def test_an_error_rolls_back_and_reaches_the_caller(database: Database) -> None:
    async def work(session: AsyncSession) -> None:
        await session.execute(text("INSERT INTO t VALUES (1)"))
        raise LookupError("no such thing")

    with pytest.raises(LookupError, match="no such thing"):
        await transaction(database.sessionmaker, work)
    assert await values(database) == []


async def test_a_cancelled_caller_waits_for_the_end_of_its_transaction(database: Database) -> None:
    inside = threading.Event()
    release = threading.Event()

    async def work(session: AsyncSession) -> None:
        await session.execute(text("INSERT INTO t VALUES (1)"))
        inside.set()
        await asyncio.to_thread(release.wait, 10)

    caller = asyncio.create_task(transaction(database.sessionmaker, work))
    assert await asyncio.to_thread(inside.wait, 10)
    caller.cancel()
    await asyncio.sleep(0.05)
    assert not caller.done()  # still waiting: the transaction holds the write turn
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert await values(database) == [1]  # it ran to its commit


async def test_write_transactions_take_turns_with_begin(database: Database) -> None:
    """A transaction on the thread and one on the caller's loop never overlap (SQLite's one writer)."""
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    async def slow(session: AsyncSession) -> None:
        order.append("thread in")
        await session.execute(text("INSERT INTO t VALUES (1)"))
        inside.set()
        await asyncio.to_thread(release.wait, 10)
        order.append("thread out")

    async def on_loop() -> None:
        async with database.sessionmaker.begin() as session:
            order.append("loop in")
            await session.execute(text("INSERT INTO t VALUES (2)"))

    first = asyncio.create_task(transaction(database.sessionmaker, slow))
    assert await asyncio.to_thread(inside.wait, 10)
    second = asyncio.create_task(on_loop())
    await asyncio.sleep(0.05)
    assert order == ["thread in"]
    release.set()
    await asyncio.gather(first, second)
    assert order == ["thread in", "thread out", "loop in"]
    assert await values(database) == [1, 2]


async def test_closing_ends_a_transaction_in_flight_with_an_error_and_refuses_later_ones(
    tmp_path: Path,
) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")
    inside = threading.Event()

    async def stuck(session: AsyncSession) -> None:
        await session.execute(text("SELECT 1"))
        inside.set()
        await asyncio.sleep(60)

    caller = asyncio.create_task(transaction(db.sessionmaker, stuck))
    assert await asyncio.to_thread(inside.wait, 10)
    await db.dispose()
    with pytest.raises(RuntimeError, match="cancelled"):
        await caller
    with pytest.raises(RuntimeError, match="closed"):
        await transaction(db.sessionmaker, stuck)


async def test_an_in_memory_database_keeps_its_transactions_on_the_callers_loop() -> None:
    db = Database("sqlite+aiosqlite:///:memory:")
    try:
        assert db.transactions is None

        async def work(session: AsyncSession) -> str:
            return threading.current_thread().name

        assert await transaction(db.sessionmaker, work) == threading.current_thread().name
    finally:
        await db.dispose()
