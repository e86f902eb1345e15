"""A2A push notification configs in the database (FACES.md N-06), on SQLite and PostgreSQL: a config
committed while a close or a park waited for the run's row is told that change (the close's own
``RETURNING`` saw the snapshot from before it waited); a task takes ten configs at most, counted
one creator after the other; a config of a task that has ended is kept, and owed nothing.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from sqlalchemy import text, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Run
from app.db.repositories import ConversationRecord, ConversationRepo, RunRecord, RunRepo
from app.db.repositories.approvals import ApprovalRepo, NewApproval
from app.db.repositories.push_configs import (
    MAX_PUSH_CONFIGS,
    NewPushConfig,
    PushConfigLimitError,
    PushConfigRepo,
    insert_push_configs,
    push_configs_of,
)
from app.db.session import Database
from app.llm.base import ChatMessage
from tests.support.server import async_wait_until


class Told:
    """A ``RunNotices`` that notes each change it is told of, with the configs it then sees."""

    def __init__(self) -> None:
        self.told: list[tuple[str, list[str]]] = []

    async def run_changed(self, session: AsyncSession, run_id: str) -> None:
        self.told.append((run_id, [c.config_id for c in await push_configs_of(session, run_id)]))


@pytest.fixture
def told() -> Told:
    return Told()


@pytest.fixture
async def conv(database: Database) -> ConversationRecord:
    return await ConversationRepo(database.sessionmaker).create("alice", "pushes", {})


async def start(runs: RunRepo, conv: ConversationRecord) -> RunRecord:
    run, _ = await runs.start(
        conv.id, "alice", "what is 6*7?", worker_id="w1", lease_s=30, start_cursor="0-0"
    )
    return run


async def finish(runs: RunRepo, run: RunRecord) -> bool:
    return await runs.finish(
        run.id,
        status="completed",
        answer="42",
        iterations=1,
        usage={},
        elapsed=0.5,
        error=None,
        pending_injections=[],
        messages=[ChatMessage(role="assistant", content="42")],
        conversation_id=run.conversation_id,
    )


async def someone_waits_for_a_lock(database: Database) -> bool:
    async with database.sessionmaker() as session:
        waiting = await session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )
    return bool(waiting)


async def while_a_config_is_created(database: Database, run: RunRecord, change: asyncio.Task[object]) -> None:
    """Hold what ``PushConfigRepo.create`` holds (the run's row, the new config) until ``change``
    waits for that row, then commit."""
    async with database.sessionmaker() as creating, creating.begin():
        await creating.execute(update(Run).where(Run.id == run.id).values(attempt=Run.attempt))
        await insert_push_configs(creating, run.id, "alice", [NewPushConfig("late", "https://p.example/a2a")])
        await asyncio.sleep(0)  # let ``change`` send its statement
        await async_wait_until(lambda: someone_waits_for_a_lock(database), what="a wait for the run's row")
        assert not change.done()


def postgres_only(backend: str) -> None:
    if backend != "postgres":
        pytest.skip("SQLite has one writer at a time: a close never waits holding an older snapshot")


async def test_a_config_committed_while_the_close_waited_for_the_run_is_told_the_close(
    database: Database, database_backend: str, conv: ConversationRecord, told: Told
) -> None:
    postgres_only(database_backend)
    runs = RunRepo(database.sessionmaker, told)
    run = await start(runs, conv)

    closing = asyncio.create_task(finish(runs, run))
    await while_a_config_is_created(database, run, closing)

    assert await closing
    assert told.told == [(run.id, ["late"])]


async def test_a_config_committed_while_the_park_waited_for_the_run_is_told_the_wait(
    database: Database, database_backend: str, conv: ConversationRecord, told: Told
) -> None:
    postgres_only(database_backend)
    approvals = ApprovalRepo(database.sessionmaker, told)
    run = await start(RunRepo(database.sessionmaker), conv)
    expires = datetime(2099, 1, 1, tzinfo=UTC)
    await approvals.request(
        NewApproval("apr_1", run.id, conv.id, "alice", "c1", "calculator", {}, 1, expires)
    )

    parking = asyncio.create_task(approvals.park(run.id, 1, "w1"))
    await while_a_config_is_created(database, run, parking)

    assert await parking == "waiting"
    assert told.told == [(run.id, ["late"])]


async def test_a_run_takes_ten_configs_counted_one_creator_after_the_other(
    database: Database, conv: ConversationRecord
) -> None:
    configs = PushConfigRepo(database.sessionmaker)
    run = await start(RunRepo(database.sessionmaker), conv)
    for i in range(MAX_PUSH_CONFIGS - 1):
        assert await configs.create("alice", run.id, NewPushConfig(f"c{i}", f"https://p.example/{i}"))

    # Two at once for the last place: one gets it.
    outcomes = await asyncio.gather(
        configs.create("alice", run.id, NewPushConfig("x", "https://p.example/x")),
        configs.create("alice", run.id, NewPushConfig("y", "https://p.example/y")),
        return_exceptions=True,
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["PushConfigLimitError", "PushConfigRecord"]
    assert len(await configs.list_configs("alice", run.id)) == MAX_PUSH_CONFIGS
    with pytest.raises(PushConfigLimitError):
        await configs.create("alice", run.id, NewPushConfig("z", "https://p.example/z"))
    # One of them given again replaces itself.
    replaced = await configs.create("alice", run.id, NewPushConfig("c0", "https://p.example/again"))
    assert replaced is not None and replaced.url == "https://p.example/again"
    assert len(await configs.list_configs("alice", run.id)) == MAX_PUSH_CONFIGS


async def test_a_config_of_a_task_that_ended_is_kept_and_owed_nothing(
    database: Database, conv: ConversationRecord, told: Told
) -> None:
    runs = RunRepo(database.sessionmaker, told)
    run = await start(runs, conv)
    assert await finish(runs, run)

    stored = await PushConfigRepo(database.sessionmaker).create(
        "alice", run.id, NewPushConfig("after", "https://p.example/a2a")
    )

    assert stored is not None and stored.config_id == "after"
    # Nothing changes after the close: nothing is owed to it. (SQLite 3.40 answers ``webhook IS
    # NOT NULL`` true in an UPDATE's RETURNING on a table with a partial unique index, as runs
    # has: there the close is told, of no config.)
    assert all(configs == [] for _, configs in told.told)
