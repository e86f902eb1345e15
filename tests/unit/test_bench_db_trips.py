"""bench/db_bench.py's count of the calls SQLite connections send to their threads."""

from __future__ import annotations

from pathlib import Path

import aiosqlite

from app.db import sqlite_driver
from bench.db_bench import counting_trips


async def test_trips_are_counted_for_both_connections_and_the_count_is_removed_after(tmp_path: Path) -> None:
    real = aiosqlite.Connection._execute
    ours = await sqlite_driver.connect(str(tmp_path / "ours.db"))
    theirs = await aiosqlite.connect(tmp_path / "theirs.db")
    try:
        with counting_trips() as trips:
            await ours.cursor().execute("SELECT 1")  # one trip: the statement, rows and close
            await ours.rollback()  # nothing to end: no trip
            cursor = await theirs.execute("SELECT 1")  # aiosqlite's own: execute
            await cursor.fetchall()  # and fetch
    finally:
        await ours.close()
        await theirs.close()
    assert trips == [3]
    assert aiosqlite.Connection._execute is real
