"""What SQLAlchemy's layers cost a statement on the event loop: one transaction of two Core
statements (an UPDATE, a SELECT of one row) through an ORM ``Session``, through the session's
connection, and through an engine connection with no session at all.

CPU time of this process only (the database server's is not in it), per transaction, three
interleaved rounds of 2,000 after 100 to warm up. On PostgreSQL (asyncpg) all of it is the event
loop's; on SQLite (aiosqlite) part is the driver's thread. Loopback only; a table ``stmt_bench`` is
made in the database named by the URL and dropped at the end.

``python -m bench.stmt_cost postgresql+asyncpg://postgres@127.0.0.1:5432/test``
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

from sqlalchemy import column, select, table, text, update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

TRANSACTIONS = 2000


async def measure(url: str) -> dict[str, list[float]]:
    engine = create_async_engine(url, pool_size=2)
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS stmt_bench (id TEXT PRIMARY KEY, v INTEGER)"))
        await conn.execute(text("DELETE FROM stmt_bench"))
        await conn.execute(text("INSERT INTO stmt_bench VALUES ('a', 1)"))
    rows = table("stmt_bench", column("id"), column("v"))
    read = select(rows.c.v).where(rows.c.id == "a")
    write = update(rows).where(rows.c.id == "a").values(v=rows.c.v + 1)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def via_session() -> None:
        async with sessions.begin() as session:
            await session.execute(write)
            (await session.execute(read)).first()

    async def via_session_connection() -> None:
        async with sessions.begin() as session:
            conn = await session.connection()
            await conn.execute(write)
            (await conn.execute(read)).first()

    async def via_engine() -> None:
        async with engine.begin() as conn:
            await conn.execute(write)
            (await conn.execute(read)).first()

    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "Session.execute": via_session,
        "the session's connection": via_session_connection,
        "an engine connection": via_engine,
    }
    out: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for _ in range(3):
            for name, way in ways.items():
                for _ in range(100):
                    await way()
                started = time.process_time()
                for _ in range(TRANSACTIONS):
                    await way()
                out[name].append(round(1e6 * (time.process_time() - started) / TRANSACTIONS))
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("DROP TABLE stmt_bench"))
        await engine.dispose()
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for name, rounds in asyncio.run(measure(sys.argv[1])).items():
        print(f"{name:28s} {' '.join(f'{r:6.0f}' for r in rounds)} µs CPU per transaction (2 statements)")


if __name__ == "__main__":
    main()
