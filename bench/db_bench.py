"""The database work of one run's life, through the repositories, in-process.

A run over the HTTP API costs the worker these database operations (in this order): create the
conversation; read it (POST .../runs checks the owner); start the run (run row, history read and the
question, one transaction); read the conversation, the running run and the last stored event id
(opening the stream); finish the run (the answer message, the run's row and its ``done`` event,
one transaction). The other events are written in group commits shared by all runs and are not
counted here.

Runs go one after the other (``--concurrency 1``) or many at once, on SQLite (a file in a temporary
directory) and on PostgreSQL (a database of its own on 127.0.0.1, dropped at the end). Reports the
process's CPU time (user and system, the driver's threads included) and wall time per run::

    .venv/bin/python -m bench.db_bench --runs 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import aiosqlite

from app.db.migrate import upgrade_database
from app.db.repositories import ConversationRepo, EventRepo, RunRepo
from app.db.session import Database
from app.llm.base import ChatMessage
from app.streaming.bus import StoredEvent
from bench.scratch_pg import ScratchDatabase

ANSWER = "word " * 200
DONE_DATA = json.dumps({"answer": ANSWER, "status": "completed", "iterations": 6})


async def run_life(conversations: ConversationRepo, runs: RunRepo, events: EventRepo) -> None:
    conv = await conversations.create("bench", "a question", {})
    await conversations.get("bench", conv.id)
    run, _ = await runs.start(
        conv.id, "bench", "a question", worker_id="bench", lease_s=30, start_cursor="0-0"
    )
    await conversations.get("bench", conv.id)
    await runs.active(conv.id)
    await events.last_id(conv.id)
    await runs.finish(
        run.id,
        status="completed",
        answer=ANSWER,
        iterations=6,
        usage={"prompt_tokens": 100, "completion_tokens": 200},
        elapsed=1.0,
        error=None,
        pending_injections=[],
        messages=[ChatMessage(role="assistant", content=ANSWER)],
        conversation_id=conv.id,
        done=StoredEvent(f"{time.time_ns() // 1_000_000}-0", "done", DONE_DATA, run.id),
    )


@contextlib.contextmanager
def counting_trips() -> Iterator[list[int]]:
    """Counts the calls SQLite connections send to their threads (aiosqlite's ``_execute``, which
    every call of aiosqlite's own connection and of ``app.db.sqlite_driver``'s goes through) while
    the block runs: ``[n]``, read after it."""
    real = aiosqlite.Connection._execute
    count = [0]

    async def counted(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return await real(self, fn, *args, **kwargs)

    aiosqlite.Connection._execute = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        aiosqlite.Connection._execute = real  # type: ignore[method-assign]


async def measure(url: str, n_runs: int, concurrency: int, warmup: int) -> dict[str, Any]:
    db = Database(url)
    repos = ConversationRepo(db.sessionmaker), RunRepo(db.sessionmaker), EventRepo(db.sessionmaker)
    try:
        for _ in range(warmup):
            await run_life(*repos)
        left = n_runs

        async def lane() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await run_life(*repos)

        with counting_trips() as trips:
            before, wall = os.times(), time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(concurrency)))
            after, wall = os.times(), time.perf_counter() - wall
    finally:
        await db.dispose()
    return {
        "runs": n_runs,
        "concurrency": concurrency,
        # SQLite only: what goes to the connection's thread (bench/NOTES.md, seventh session).
        "thread_trips_per_run": trips[0] / n_runs if db.dialect == "sqlite" else None,
        "user_ms_per_run": 1e3 * (after.user - before.user) / n_runs,
        "system_ms_per_run": 1e3 * (after.system - before.system) / n_runs,
        "cpu_ms_per_run": 1e3 * (after.user + after.system - before.user - before.system) / n_runs,
        "wall_ms_per_run": 1e3 * wall / n_runs,
    }


def on_sqlite(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{tmp}/bench.db"
        upgrade_database(url)
        return asyncio.run(measure(url, args.runs, concurrency, args.warmup))


def on_postgres(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    scratch = ScratchDatabase()
    asyncio.run(scratch.create())
    try:
        upgrade_database(scratch.url)
        return asyncio.run(measure(scratch.url, args.runs, concurrency, args.warmup))
    finally:
        asyncio.run(scratch.drop())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--db", choices=["sqlite", "postgres"], nargs="+", default=["sqlite", "postgres"])
    args = parser.parse_args(argv)
    rows = []
    for db in args.db:
        for concurrency in args.concurrency:
            row = {"database": db, **(on_sqlite if db == "sqlite" else on_postgres)(args, concurrency)}
            trips = row["thread_trips_per_run"]
            print(
                f"  db {db} x{concurrency}: {row['cpu_ms_per_run']:.2f} ms CPU/run "
                f"(user {row['user_ms_per_run']:.2f}, system {row['system_ms_per_run']:.2f}), "
                f"{row['wall_ms_per_run']:.2f} ms wall/run"
                + (f", {trips:.1f} trips to SQLite's thread/run" if trips is not None else ""),
                file=sys.stderr,
            )
            rows.append(row)
    print(json.dumps({"scenario": "database work per run", "rows": rows}))


if __name__ == "__main__":
    main()
