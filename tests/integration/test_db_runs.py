"""RunRepo against real SQLite and PostgreSQL: one running run per conversation, leases, finishing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from app.db.errors import ConversationNotFoundError, EventIdTakenError, RunActiveError
from app.db.models import FollowUp
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.run_start import Placement
from app.db.session import Database
from app.llm.base import ChatMessage
from app.streaming.bus import ZERO_CURSOR, StoredEvent


@pytest.fixture
def runs(database: Database) -> RunRepo:
    return RunRepo(database.sessionmaker)


@pytest.fixture
async def conv(database: Database) -> ConversationRecord:
    return await ConversationRepo(database.sessionmaker).create("alice", "runs", {})


async def start(
    runs: RunRepo, conv: ConversationRecord, *, worker_id: str = "w1", lease_s: float = 30
) -> RunRecord:
    run, _ = await runs.start(
        conv.id, conv.owner, "hello", worker_id=worker_id, lease_s=lease_s, start_cursor="0-0"
    )
    return run


async def finish(runs: RunRepo, run_id: str, status: str = "completed", answer: str = "done") -> bool:
    return await runs.finish(
        run_id,
        status=status,
        answer=answer,
        iterations=3,
        usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "llm_calls": 2},
        elapsed=1.25,
        error=None,
        pending_injections=["late note"],
    )


async def test_create_stores_a_running_run_leased_to_the_worker(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    before = datetime.now(UTC)

    run, _ = await runs.start(
        conv.id, "alice", "what is 2+2?", worker_id="w1", lease_s=30, start_cursor="17-3"
    )

    assert run.id.startswith("run_") and len(run.id) >= 24
    assert (run.status, run.message, run.start_cursor, run.worker_id) == (
        "running",
        "what is 2+2?",
        "17-3",
        "w1",
    )
    assert (run.answer, run.elapsed, run.error, run.finished_at) == (None, None, None, None)
    assert run.iterations == 0 and run.usage == {} and run.pending_injections == []
    assert run.lease_expires_at is not None
    assert before + timedelta(seconds=29) < run.lease_expires_at <= datetime.now(UTC) + timedelta(seconds=30)
    assert await runs.get_any(run.id) == run


async def test_get_of_another_owners_run_returns_none(runs: RunRepo, conv: ConversationRecord) -> None:
    run = await start(runs, conv)

    assert await runs.get("alice", run.id) == run
    assert await runs.get("mallory", run.id) is None
    assert await runs.get_any("run_missing") is None


async def test_second_start_while_a_run_is_running_raises_run_active(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    first = await start(runs, conv)

    with pytest.raises(RunActiveError) as caught:
        await start(runs, conv)

    assert caught.value.conversation_id == conv.id
    assert await runs.active(conv.id) == first


async def test_two_concurrent_starts_exactly_one_wins(runs: RunRepo, conv: ConversationRecord) -> None:
    outcomes = await asyncio.gather(
        start(runs, conv), start(runs, conv), start(runs, conv), return_exceptions=True
    )

    won = [o for o in outcomes if isinstance(o, RunRecord)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1
    assert len(lost) == 2 and all(isinstance(o, RunActiveError) for o in lost)
    assert await runs.active(conv.id) == won[0]


async def test_two_workers_sharing_the_database_cannot_both_start_a_run(
    migrated_database_url: str, conv: ConversationRecord
) -> None:
    # Two Database handles: two workers' engines and pools on one SQLite file or PostgreSQL.
    workers = [Database(migrated_database_url), Database(migrated_database_url)]
    try:
        outcomes = await asyncio.gather(
            *(start(RunRepo(db.sessionmaker), conv, worker_id=f"w{i}") for i, db in enumerate(workers)),
            return_exceptions=True,
        )
    finally:
        for db in workers:
            await db.dispose()

    assert sorted(type(o).__name__ for o in outcomes) == ["RunActiveError", "RunRecord"]


async def test_runs_of_different_conversations_run_side_by_side(database: Database, runs: RunRepo) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    a = await conversations.create("alice", "a", {})
    b = await conversations.create("alice", "b", {})

    run_a, run_b = await asyncio.gather(start(runs, a), start(runs, b))

    assert run_a.status == run_b.status == "running"


async def test_start_for_a_missing_conversation_raises_conversation_not_found(runs: RunRepo) -> None:
    with pytest.raises(ConversationNotFoundError):
        await runs.start("conv_missing", "alice", "hi", worker_id="w1", lease_s=30, start_cursor="0-0")


async def test_a_new_run_can_start_once_the_previous_finished(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    first = await start(runs, conv)
    assert await finish(runs, first.id)

    second = await start(runs, conv)

    assert await runs.active(conv.id) == second
    assert await runs.latest(conv.id) == second


async def test_finish_stores_the_outcome_and_only_the_first_finish_counts(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    run = await start(runs, conv)

    assert await finish(runs, run.id, status="completed", answer="4") is True
    assert await finish(runs, run.id, status="failed", answer="worker lost") is False

    done = await runs.get_any(run.id)
    assert done is not None
    assert (done.status, done.answer, done.iterations, done.elapsed, done.error) == (
        "completed",
        "4",
        3,
        1.25,
        None,
    )
    assert done.usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "llm_calls": 2}
    assert done.pending_injections == ["late note"]
    assert done.finished_at is not None and done.finished_at.tzinfo == UTC
    assert done.lease_expires_at is None
    assert await runs.active(conv.id) is None


async def test_concurrent_finishes_exactly_one_wins(runs: RunRepo, conv: ConversationRecord) -> None:
    run = await start(runs, conv)

    results = await asyncio.gather(
        finish(runs, run.id, status="cancelled", answer="a"),
        finish(runs, run.id, status="failed", answer="b"),
    )

    assert sorted(results) == [False, True]


async def test_finish_of_an_unknown_run_returns_false(runs: RunRepo) -> None:
    assert await finish(runs, "run_missing") is False


async def test_finish_with_a_non_final_status_is_refused(runs: RunRepo, conv: ConversationRecord) -> None:
    run = await start(runs, conv)

    with pytest.raises(ValueError, match="running"):
        await finish(runs, run.id, status="running")

    assert (await runs.active(conv.id)) == run


async def test_latest_is_the_most_recent_run_and_none_without_runs(
    runs: RunRepo, conv: ConversationRecord
) -> None:
    assert await runs.latest(conv.id) is None
    assert await runs.active(conv.id) is None
    first = await start(runs, conv)
    await finish(runs, first.id)
    second = await start(runs, conv)
    await finish(runs, second.id, status="cancelled")

    latest = await runs.latest(conv.id)

    assert latest is not None and latest.id == second.id and latest.status == "cancelled"


async def test_claimable_lists_running_runs_whose_lease_ran_out_or_that_were_released(
    database: Database, runs: RunRepo
) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    short = await start(runs, await conversations.create("alice", "short", {}), lease_s=10)
    long = await start(runs, await conversations.create("alice", "long", {}), lease_s=100)
    finished = await start(runs, await conversations.create("alice", "finished", {}), lease_s=10)
    await finish(runs, finished.id)
    mine = await start(runs, await conversations.create("alice", "mine", {}), worker_id="me", lease_s=1)
    now = datetime.now(UTC)

    assert await runs.claimable("me", now=now) == []
    assert [r.id for r in await runs.claimable("me", now=now + timedelta(seconds=50))] == [short.id]
    later = now + timedelta(seconds=500)
    assert [r.id for r in await runs.claimable("me", now=later)] == [short.id, long.id]
    assert [r.id for r in await runs.claimable("other", now=later)] == [short.id, long.id, mine.id]
    assert await runs.release(long.id, long.attempt, "w1")
    assert [r.id for r in await runs.claimable("me", now=now)] == [long.id]
    # Runs of workers the caller knows are gone are listed whatever their lease.
    assert [r.id for r in await runs.claimable("me", held_by=["w1"], now=now)] == [short.id, long.id]
    assert await runs.holders("w") == ["w1"]
    assert sorted(await runs.holders("")) == ["me", "w1"]


async def test_renew_leases_extends_only_the_workers_running_runs(database: Database, runs: RunRepo) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    mine = await start(runs, await conversations.create("alice", "mine", {}), worker_id="w1", lease_s=5)
    theirs = await start(runs, await conversations.create("alice", "theirs", {}), worker_id="w2", lease_s=5)

    await runs.renew_leases([mine.id, theirs.id], "w1", lease_s=300)

    renewed, untouched = await runs.get_any(mine.id), await runs.get_any(theirs.id)
    assert renewed is not None and untouched is not None
    assert renewed.lease_expires_at is not None and mine.lease_expires_at is not None
    assert renewed.lease_expires_at >= mine.lease_expires_at + timedelta(seconds=290)
    assert untouched.lease_expires_at == theirs.lease_expires_at
    soon = datetime.now(UTC) + timedelta(seconds=60)
    assert [r.id for r in await runs.claimable("w3", now=soon)] == [theirs.id]


async def test_renew_leases_does_not_revive_a_finished_run(runs: RunRepo, conv: ConversationRecord) -> None:
    run = await start(runs, conv)
    await finish(runs, run.id)

    await runs.renew_leases([run.id], "w1", lease_s=300)

    done = await runs.get_any(run.id)
    assert done is not None and done.status == "completed" and done.lease_expires_at is None


async def test_running_of_worker_lists_only_that_workers_running_runs(
    database: Database, runs: RunRepo
) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    a = await start(runs, await conversations.create("alice", "a", {}), worker_id="w1")
    b = await start(runs, await conversations.create("alice", "b", {}), worker_id="w1")
    await start(runs, await conversations.create("alice", "c", {}), worker_id="w2")
    await finish(runs, b.id)

    assert [r.id for r in await runs.running_of_worker("w1")] == [a.id]
    assert await runs.running_of_worker("w3") == []


async def test_counts_by_status_counts_every_status_including_zeros(
    database: Database, runs: RunRepo
) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    zeros = dict.fromkeys(("queued", "running", "waiting", "completed", "failed", "cancelled"), 0)
    assert await runs.counts_by_status() == zeros
    for status in ("completed", "completed", "failed", None):
        run = await start(runs, await conversations.create("alice", "c", {}))
        if status is not None:
            await finish(runs, run.id, status=status)

    assert await runs.counts_by_status() == {**zeros, "running": 1, "completed": 2, "failed": 1}


# ---- start and finish in one transaction each -------------------------------------------------


async def test_start_stores_prior_turns_and_the_question_and_returns_the_history_before_it(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    await conversations.add_messages(conv.id, None, [ChatMessage(role="user", content="earlier")])
    prior = [ChatMessage(role="assistant", content="sent along with the question")]

    run, history = await runs.start(
        conv.id, "alice", "now?", worker_id="w1", lease_s=30, start_cursor="0-0", prior=prior
    )

    assert [m.content for m in history] == ["earlier", "sent along with the question"]
    stored = await conversations.messages(conv.id)
    assert [(m.content, m.run_id) for m in stored] == [
        ("earlier", None),
        ("sent along with the question", None),
        ("now?", run.id),
    ]
    assert (await runs.active(conv.id)) == run


async def test_a_start_that_loses_to_a_running_run_stores_nothing(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    first, _ = await runs.start(conv.id, "alice", "one", worker_id="w1", lease_s=30, start_cursor="0-0")
    prior = [ChatMessage(role="user", content="prior")]

    with pytest.raises(RunActiveError):
        await runs.start(conv.id, "alice", "two", worker_id="w1", lease_s=30, start_cursor="0-0", prior=prior)

    stored = await ConversationRepo(database.sessionmaker).messages(conv.id)
    assert [m.content for m in stored] == ["one"] and (await runs.active(conv.id)) == first


async def test_finish_stores_the_runs_messages_with_the_close(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="w1", lease_s=30, start_cursor="0-0")
    said = [ChatMessage(role="assistant", content="a"), ChatMessage(role="user", content="note", pinned=True)]

    assert await close(runs, run, messages=said, pending=["note"])
    assert (await runs.get_any(run.id)).pending_injections == ["note"]  # type: ignore[union-attr]
    stored = await ConversationRepo(database.sessionmaker).messages(conv.id)
    assert [(m.content, m.run_id, m.pinned) for m in stored] == [
        ("q", run.id, False),
        ("a", run.id, False),
        ("note", run.id, True),
    ]


def done_event(event_id: str, run_id: str, status: str = "completed") -> StoredEvent:
    return StoredEvent(event_id, "done", f'{{"status":"{status}","run_id":"{run_id}"}}', run_id)


async def close(
    runs: RunRepo,
    run: RunRecord,
    *,
    done: StoredEvent | None = None,
    messages: list[ChatMessage] | None = None,
    pending: list[str] | None = None,
) -> bool:
    return await runs.finish(
        run.id,
        status="completed",
        answer="a",
        iterations=1,
        usage={},
        elapsed=0.1,
        error=None,
        pending_injections=pending or [],
        messages=messages or [],
        conversation_id=run.conversation_id,
        done=done,
    )


async def close_with_done(
    runs: RunRepo, run: RunRecord, done: StoredEvent, messages: list[ChatMessage] | None = None
) -> bool:
    return await close(runs, run, done=done, messages=messages)


async def test_finish_stores_its_done_with_the_close_and_a_losing_finish_stores_none(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)
    run = await start(runs, conv)
    first = done_event("1000-0", run.id)

    assert await close_with_done(runs, run, first) is True
    assert await close_with_done(runs, run, done_event("2000-0", run.id)) is False

    assert await events.read_after(conv.id, ZERO_CURSOR) == [first]


async def test_a_retried_finish_whose_close_was_committed_is_true_and_stores_nothing_twice(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    """The close committed but its answer was lost (the connection broke): the retry sees its own
    done stored and reports the close as its own, without a second copy of the run's messages."""
    run = await start(runs, conv)
    done = done_event("1000-0", run.id)
    said = [ChatMessage(role="assistant", content="a")]

    assert await close_with_done(runs, run, done, said) is True
    assert await close_with_done(runs, run, done, said) is True

    stored = await ConversationRepo(database.sessionmaker).messages(conv.id)
    assert [m.content for m in stored] == ["hello", "a"]
    assert await EventRepo(database.sessionmaker).read_after(conv.id, ZERO_CURSOR) == [done]


async def test_a_new_run_starts_after_the_previous_runs_done_even_if_the_bus_had_not_got_it(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    first = await start(runs, conv)
    assert await close_with_done(runs, first, done_event("1000-4", first.id))

    # What the bus held when the next run was asked for: the event before that done.
    second, _ = await runs.start(
        conv.id, conv.owner, "again", worker_id="w1", lease_s=30, start_cursor="1000-3"
    )
    assert second.start_cursor == "1000-4"
    assert await runs.get_any(second.id) == second
    assert await finish(runs, second.id)

    # A bus ahead of the database (events not stored yet) keeps its own cursor.
    third, _ = await runs.start(
        conv.id, conv.owner, "more", worker_id="w1", lease_s=30, start_cursor="2000-0"
    )
    assert third.start_cursor == "2000-0" and (await runs.get_any(third.id)) == third


async def test_a_finish_losing_to_another_closers_done_under_the_same_id_is_false_and_keeps_its_messages(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    """Two closers that took their done's id from the same last event (a reaper and a stalled
    worker) may stamp the same id: only the one whose done is stored closed the run."""
    events = EventRepo(database.sessionmaker)
    run = await start(runs, conv)
    winner = done_event("1000-0", run.id, status="failed")
    assert await close_with_done(runs, run, winner)

    loser = done_event("1000-0", run.id, status="completed")
    assert await close_with_done(runs, run, loser, [ChatMessage(role="user", content="late note")]) is False

    assert await events.read_after(conv.id, ZERO_CURSOR) == [winner]
    stored = await ConversationRepo(database.sessionmaker).messages(conv.id)
    assert [m.content for m in stored] == ["hello", "late note"]


async def test_a_close_whose_done_id_another_process_took_keeps_nothing_and_says_so(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    events = EventRepo(database.sessionmaker)
    run = await start(runs, conv)
    other = StoredEvent("1000-0", "step", '{"run_id":"elsewhere"}', "run_elsewhere")
    await events.save(conv.id, [other])

    with pytest.raises(EventIdTakenError):
        said = [ChatMessage(role="assistant", content="a")]
        await close_with_done(runs, run, done_event("1000-0", run.id), said)

    assert (await runs.get_any(run.id)).status == "running"  # type: ignore[union-attr]
    assert [m.content for m in await ConversationRepo(database.sessionmaker).messages(conv.id)] == ["hello"]
    assert await events.read_after(conv.id, ZERO_CURSOR) == [other]
    assert await close_with_done(runs, run, done_event("1000-1", run.id))
    assert await events.holds(conv.id, done_event("1000-1", run.id))
    assert not await events.holds(conv.id, done_event("1000-0", run.id))


async def test_follow_ups_a_run_missed_stay_on_its_branch_when_the_next_run_asks_elsewhere(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    # FACES.md B-02: follow-ups accepted after the previous run took its last ones belong to that
    # run's branch. A question asked below the current leaf has them in its history (as before
    # trees); an edit asks elsewhere: they stay below the old leaf, out of the edit's history.
    conversations = ConversationRepo(database.sessionmaker)
    first = await start(runs, conv)
    assert await runs.finish(
        first.id,
        status="completed",
        answer="a1",
        iterations=1,
        usage={},
        elapsed=1.0,
        error=None,
        pending_injections=[],
        messages=[ChatMessage(role="assistant", content="a1")],
        conversation_id=conv.id,
    )
    answer = (await conversations.messages(conv.id))[-1]
    async with database.sessionmaker.begin() as session:
        session.add(FollowUp(conversation_id=conv.id, content="missed"))

    edit, history = await runs.start(
        conv.id,
        conv.owner,
        "edited",
        worker_id="w1",
        lease_s=30,
        start_cursor="0-0",
        placement=Placement(under_head=False, parent_seq=None),
    )

    assert history == []
    stored = {m.content: m for m in await conversations.messages(conv.id)}
    assert stored["missed"].parent_seq == answer.seq and stored["missed"].pinned
    assert stored["edited"].parent_seq is None and edit.question_seq == stored["edited"].seq
    assert await conversations.head(conv.id) == stored["edited"].seq
    assert await runs.history_before(edit) == []
