"""Follow-ups in the database (RUNS.md R-11) against real SQLite and PostgreSQL, with the in-process
hints and with Redis's: posted through one worker, taken by a run on another, none lost or taken
twice, also by a new attempt that starts from the position a checkpoint recorded."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from app.db.repositories import ConversationRecord, ConversationRepo, RunRepo
from app.db.repositories.follow_ups import FollowUpRepo
from app.db.session import Database
from app.engine.interrupts import InterruptQueueFullError
from app.runs.follow_ups import DurableInterruptQueue, FollowUpHints, MemoryFollowUpHints
from app.streaming.redis_signals import RedisFollowUpHints

REDIS_URL = os.environ.get("AGENTSTREAM_TEST_REDIS", "redis://127.0.0.1:6379/0")


class CountingRepo(FollowUpRepo):
    """A FollowUpRepo that counts the reads of the queue (each is a database round trip)."""

    reads = 0

    async def after(self, conversation_id: str, position: int) -> list:  # type: ignore[type-arg]
        self.reads += 1
        return await super().after(conversation_id, position)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def hints(request: pytest.FixtureRequest) -> AsyncIterator[FollowUpHints]:
    if request.param == "memory":
        yield MemoryFollowUpHints()
        return
    client: Redis = Redis.from_url(REDIS_URL)
    prefix = f"agentstream-test:{secrets.token_hex(6)}"
    try:
        yield RedisFollowUpHints(client, prefix)
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def repo(database: Database) -> CountingRepo:
    return CountingRepo(database.sessionmaker)


@pytest.fixture
async def conv(database: Database) -> ConversationRecord:
    return await ConversationRepo(database.sessionmaker).create("alice", "follow-ups", {})


async def test_a_follow_up_posted_through_one_worker_is_taken_by_the_run_on_another(
    repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    poster = DurableInterruptQueue(repo, hints, conv.id)
    run = DurableInterruptQueue(repo, hints, conv.id)

    assert await run.drain() == []
    assert await poster.put("first") == 1
    assert await poster.put("second, with ünïcode\nand a newline") == 2
    assert await run.drain() == ["first", "second, with ünïcode\nand a newline"]
    assert await run.drain() == []
    assert run.position is not None


async def test_a_run_with_no_follow_ups_does_not_ask_the_database_at_every_drain(
    repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    run = DurableInterruptQueue(repo, hints, conv.id)
    for _ in range(20):
        assert await run.drain() == []
    assert repo.reads == 1  # the first drain looks; the hint says nothing came since

    await DurableInterruptQueue(repo, hints, conv.id).put("now")
    assert await run.drain() == ["now"]
    assert repo.reads == 2


async def test_a_new_run_that_saw_the_hint_before_it_started_asks_the_database_only_once_it_moves(
    repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    seen = await hints.version(conv.id)
    run = DurableInterruptQueue(repo, hints, conv.id, seen=seen)
    assert await run.drain() == [] and repo.reads == 0
    await DurableInterruptQueue(repo, hints, conv.id).put("then")
    assert await run.drain() == ["then"] and repo.reads == 1


async def test_concurrent_posts_and_drains_lose_and_repeat_nothing(
    repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    poster = DurableInterruptQueue(repo, hints, conv.id, limit=1000)
    run = DurableInterruptQueue(repo, hints, conv.id)
    drained: list[str] = []
    stop = asyncio.Event()

    async def drain_loop() -> None:
        while not stop.is_set():
            drained.extend(await run.drain())
            await asyncio.sleep(0)

    task = asyncio.create_task(drain_loop())
    sent = [f"m{i}" for i in range(60)]
    for message in sent:
        await poster.put(message)
    stop.set()
    await task
    drained.extend(await run.drain())
    assert drained == sent


async def test_a_new_attempt_takes_the_follow_ups_after_the_position_its_checkpoint_holds(
    repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    first = DurableInterruptQueue(repo, hints, conv.id)
    for text in ("a", "b"):
        await first.put(text)
    assert await first.drain() == ["a", "b"]
    checkpointed = first.position
    await first.put("c")
    assert await first.drain() == ["c"]  # taken, but the worker died before a checkpoint said so

    second = DurableInterruptQueue(repo, hints, conv.id, position=checkpointed)
    assert await second.drain() == ["c"]


async def test_the_limit_holds_for_concurrent_posts_and_counts_only_what_waits(
    database: Database, repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    queues = [DurableInterruptQueue(repo, hints, conv.id, limit=10) for _ in range(2)]

    async def put(n: int) -> bool:
        try:
            await queues[n % 2].put(f"m{n}")
        except InterruptQueueFullError:
            return False
        return True

    accepted = await asyncio.gather(*(put(n) for n in range(30)))
    assert sum(accepted) == 10

    run = DurableInterruptQueue(repo, hints, conv.id)
    assert len(await run.drain()) == 10
    with pytest.raises(InterruptQueueFullError):
        await queues[0].put("taken but not yet recorded taken: still counted")
    # A checkpoint (or the close) records them taken and they leave the queue.
    run_repo = RunRepo(database.sessionmaker)
    started, _ = await run_repo.start(conv.id, "alice", "q", worker_id="w", lease_s=30, start_cursor="0-0")
    assert await run_repo.finish(
        started.id,
        status="completed",
        answer="",
        iterations=1,
        usage={},
        elapsed=0.1,
        error=None,
        pending_injections=[],
        conversation_id=conv.id,
        follow_ups_through=run.position,
    )
    assert await queues[0].put("room again") == 1


async def test_follow_ups_left_when_no_run_is_running_go_to_the_conversation_once(
    database: Database, repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    run_repo = RunRepo(database.sessionmaker)
    run, _ = await run_repo.start(conv.id, "alice", "q", worker_id="w", lease_s=30, start_cursor="0-0")
    await DurableInterruptQueue(repo, hints, conv.id).put("late")

    assert await repo.keep_if_no_run(conv.id, run.id) == []  # the run still runs: it takes it
    assert await run_repo.finish(
        run.id,
        status="completed",
        answer="",
        iterations=1,
        usage={},
        elapsed=0.1,
        error=None,
        pending_injections=[],
    )
    assert await repo.keep_if_no_run(conv.id, run.id) == ["late"]
    assert await repo.keep_if_no_run(conv.id, run.id) == []
    messages = await ConversationRepo(database.sessionmaker).messages(conv.id)
    assert [(m.content, m.pinned) for m in messages if m.content == "late"] == [("late", True)]
    assert await DurableInterruptQueue(repo, hints, conv.id).drain() == []


async def test_follow_ups_no_run_took_join_the_next_runs_history_before_its_question(
    database: Database, repo: CountingRepo, hints: FollowUpHints, conv: ConversationRecord
) -> None:
    """Accepted in the moment the previous run closed (after its last drain): the next run starts
    with them in its history, and its own queue holds only what comes after its start."""
    await repo.add(conv.id, "late one", limit=10)
    await repo.add(conv.id, "late two", limit=10)

    run, history = await RunRepo(database.sessionmaker).start(
        conv.id, "alice", "the question", worker_id="w", lease_s=30, start_cursor="0-0"
    )

    assert [(m.content, m.pinned) for m in history] == [("late one", True), ("late two", True)]
    assert await repo.after(conv.id, 0) == []
    messages = await ConversationRepo(database.sessionmaker).messages(conv.id)
    assert [m.content for m in messages] == ["late one", "late two", "the question"]
    assert messages[-1].run_id == run.id
