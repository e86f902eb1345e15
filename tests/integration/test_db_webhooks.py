"""The webhooks' outbox against real SQLite and PostgreSQL (FACES.md N-06, N-07): deliveries stored
in the transactions that park and close runs (and only then), claims that two workers never share,
leases that bring a dead worker's claims back, outcomes fenced by the claim, and the push configs of
tasks with their owners kept apart."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from sqlalchemy import update

from app.db.models import Run, WebhookDelivery, utcnow
from app.db.repositories import ConversationRecord, ConversationRepo, RunRecord, RunRepo
from app.db.repositories.approvals import ApprovalRepo, NewApproval
from app.db.repositories.push_configs import NewPushConfig, PushConfigRepo
from app.db.session import Database
from app.llm.base import ChatMessage
from app.webhooks.notices import OutboxNotices
from app.webhooks.outbox import NewDelivery, _prunable
from tests.support.outbox import InspectableOutbox

HOOK = "https://hooks.example.com/agentstream"


@pytest.fixture
def outbox(database: Database) -> InspectableOutbox:
    return InspectableOutbox(database.sessionmaker)


@pytest.fixture
def notices() -> OutboxNotices:
    return OutboxNotices("default-model")


@pytest.fixture
def runs(database: Database, notices: OutboxNotices) -> RunRepo:
    return RunRepo(database.sessionmaker, notices)


@pytest.fixture
async def conv(database: Database) -> ConversationRecord:
    return await ConversationRepo(database.sessionmaker).create("alice", "hooks", {})


async def start(runs: RunRepo, conv: ConversationRecord, **kw: Any) -> RunRecord:
    run, _ = await runs.start(
        conv.id, "alice", "what is 6*7?", worker_id="w1", lease_s=30, start_cursor="0-0", **kw
    )
    return run


async def finish(runs: RunRepo, run: RunRecord, status: str = "completed", **kw: Any) -> bool:
    return await runs.finish(
        run.id,
        status=status,
        answer="42",
        iterations=1,
        usage={"prompt_tokens": 3},
        elapsed=1.25,
        error=None if status == "completed" else "it broke",
        pending_injections=[],
        messages=[ChatMessage(role="assistant", content="42")],
        conversation_id=run.conversation_id,
        **kw,
    )


async def queue(outbox: InspectableOutbox, count: int = 1, url: str = HOOK) -> list[str]:
    return await outbox.enqueue(
        [NewDelivery("run", f"run_{i}", "completed", url, "{}") for i in range(count)]
    )


# ---- stored with the change ------------------------------------------------------------------


async def test_a_run_with_a_webhook_owes_its_record_from_the_transaction_that_closes_it(
    runs: RunRepo, outbox: InspectableOutbox, conv: ConversationRecord
) -> None:
    run = await start(runs, conv, webhook=HOOK, model="fast")
    assert (await runs.get_any(run.id)).webhook == HOOK  # type: ignore[union-attr]
    assert await outbox.of_run(run.id) == []

    assert await finish(runs, run)

    (delivery,) = await outbox.of_run(run.id)
    closed = await runs.get_any(run.id)
    assert closed is not None and closed.finished_at is not None
    assert (delivery.kind, delivery.event, delivery.url, delivery.attempts) == ("run", "completed", HOOK, 0)
    assert orjson.loads(delivery.body) == {
        "run_id": run.id,
        "conversation_id": conv.id,
        "status": "completed",
        "answer": "42",
        "iterations": 1,
        "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 0, "llm_calls": 0},
        "elapsed": 1.25,
        "error": None,
        "created_at": closed.created_at.isoformat(),
        "finished_at": closed.finished_at.isoformat(),
        "attempt": 1,
        "model": "fast",
        "pending_approvals": [],
        "trace_id": None,
        "pending_tool_calls": [],
        "replay_of": None,
    }
    assert delivery.next_attempt_at <= utcnow() and delivery.claimed_by is None
    # A second close of the same run (another closer, a retry) owes nothing more.
    assert not await finish(runs, run, "failed")
    assert len(await outbox.of_run(run.id)) == 1


async def test_a_run_without_listeners_owes_nothing_and_a_repo_without_notices_stores_nothing(
    database: Database, runs: RunRepo, outbox: InspectableOutbox, conv: ConversationRecord
) -> None:
    quiet = await start(runs, conv)
    assert await finish(runs, quiet)
    hooked = await start(RunRepo(database.sessionmaker), conv, webhook=HOOK)
    assert await finish(RunRepo(database.sessionmaker), hooked)

    assert await outbox.of_run(quiet.id) == [] and await outbox.of_run(hooked.id) == []
    assert await outbox.pending_count() == 0


async def test_a_close_that_rolls_back_owes_nothing(
    runs: RunRepo, outbox: InspectableOutbox, conv: ConversationRecord, notices: OutboxNotices
) -> None:
    run = await start(runs, conv, webhook=HOOK)

    async def broken(session: Any, run_id: str) -> None:
        await OutboxNotices.run_changed(notices, session, run_id)
        raise RuntimeError("the transaction dies after the delivery was stored")

    notices.run_changed = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await finish(runs, run)

    assert await outbox.of_run(run.id) == []
    assert (await runs.get_any(run.id)).status == "running"  # type: ignore[union-attr]


async def test_a_run_that_parks_owes_its_waiting_record_with_what_it_waits_for_and_push_configs_their_update(
    database: Database,
    runs: RunRepo,
    outbox: InspectableOutbox,
    conv: ConversationRecord,
    notices: OutboxNotices,
) -> None:
    approvals = ApprovalRepo(database.sessionmaker, notices)
    config = NewPushConfig(
        "cfg-1", "https://push.example.com/a2a", "tok", {"scheme": "Bearer", "credentials": "c"}
    )
    run = await start(runs, conv, webhook=HOOK, push_configs=[config])
    expires = datetime(2099, 1, 1, tzinfo=UTC)
    await approvals.request(
        NewApproval("apr_1", run.id, conv.id, "alice", "call_1", "calculator", {"x": 1}, 1, expires)
    )
    await approvals.request(
        NewApproval("apr_2", run.id, conv.id, "alice", "call_2", "browser_tool", {}, 1, expires, "client")
    )

    assert await approvals.park(run.id, 1, "w1") == "waiting"

    hook, push = await outbox.of_run(run.id)
    record = orjson.loads(hook.body)
    assert (hook.kind, hook.event, record["status"]) == ("run", "waiting", "waiting")
    assert [a["approval_id"] for a in record["pending_approvals"]] == ["apr_1"]
    assert [c["call_id"] for c in record["pending_tool_calls"]] == ["call_2"]
    assert (push.kind, push.event, push.url) == ("a2a_push", "waiting", "https://push.example.com/a2a")
    assert push.headers == {"X-A2A-Notification-Token": "tok", "Authorization": "Bearer c"}
    update_ = orjson.loads(push.body)["statusUpdate"]
    assert (update_["taskId"], update_["contextId"]) == (run.id, conv.id)
    assert update_["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    parts = [p["data"] for p in update_["status"]["message"]["parts"]]
    assert [p.get("approval_id") or p.get("call_id") for p in parts] == ["apr_1", "call_2"]


async def test_a_park_whose_approvals_were_decided_already_owes_nothing(
    database: Database,
    runs: RunRepo,
    outbox: InspectableOutbox,
    conv: ConversationRecord,
    notices: OutboxNotices,
) -> None:
    approvals = ApprovalRepo(database.sessionmaker, notices)
    run = await start(runs, conv, webhook=HOOK)
    expires = datetime(2099, 1, 1, tzinfo=UTC)
    found = await approvals.request(
        NewApproval("apr_1", run.id, conv.id, "alice", "c1", "calculator", {}, 1, expires)
    )
    await approvals.decide(found, status="approved", reason=None, decided_args={}, decided_by="alice")

    assert await approvals.park(run.id, 1, "w1") == "released"
    assert await outbox.of_run(run.id) == []


async def test_a_completed_task_with_push_configs_owes_its_answer_then_its_status_to_each(
    database: Database, runs: RunRepo, outbox: InspectableOutbox, conv: ConversationRecord
) -> None:
    run = await start(
        runs,
        conv,
        push_configs=[NewPushConfig("a", "https://a.example/p"), NewPushConfig("b", "https://b.example/p")],
    )

    assert await finish(runs, run)

    owed = await outbox.of_run(run.id)
    assert [(d.url, next(iter(orjson.loads(d.body)))) for d in owed] == [
        ("https://a.example/p", "artifactUpdate"),
        ("https://a.example/p", "statusUpdate"),
        ("https://b.example/p", "artifactUpdate"),
        ("https://b.example/p", "statusUpdate"),
    ]
    artifact = orjson.loads(owed[0].body)["artifactUpdate"]
    assert artifact["artifact"]["parts"] == [{"text": "42"}] and artifact["lastChunk"] is True
    assert orjson.loads(owed[1].body)["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert all(d.headers == {} for d in owed)
    # Claimed in the order they were queued.
    claimed = await outbox.claim("w", 10, 30)
    assert [d.id for d in claimed] == [d.id for d in owed]


# ---- claims --------------------------------------------------------------------------------


async def test_workers_claiming_at_once_never_claim_the_same_delivery(
    migrated_database_url: str, outbox: InspectableOutbox
) -> None:
    ids = await queue(outbox, 30)
    workers = [Database(migrated_database_url) for _ in range(4)]
    try:
        claims = await asyncio.gather(
            *(
                InspectableOutbox(db.sessionmaker).claim(f"w{i}", 10, 30)
                for i, db in enumerate(workers)
                for _ in range(2)
            )
        )
    finally:
        for db in workers:
            await db.dispose()

    claimed = [d.id for batch in claims for d in batch]
    assert len(claimed) == len(set(claimed)) == 30
    assert set(claimed) == set(ids)
    assert all(d.attempts == 1 for batch in claims for d in batch)
    assert await outbox.claim("late", 10, 30) == []


async def test_a_claim_held_is_not_due_and_a_lapsed_one_is_claimed_again_for_the_next_attempt(
    outbox: InspectableOutbox,
) -> None:
    (delivery_id,) = await queue(outbox)
    (first,) = await outbox.claim("dead", 5, 30)
    assert (first.claimed_by, first.attempts) == ("dead", 1)
    assert await outbox.claim("other", 5, 30) == []

    later = utcnow() + timedelta(seconds=31)
    (second,) = await outbox.claim("other", 5, 30, now=later)

    assert (second.id, second.claimed_by, second.attempts) == (delivery_id, "other", 2)
    # The dead worker's attempt, back too late, records nothing: its claim is gone.
    assert not await outbox.failed(first, "dead", "late", retry_at=utcnow())
    assert await outbox.renew([first], "dead", 30) == set()
    assert await outbox.renew([second], "other", 30) == {delivery_id}
    assert await outbox.failed(second, "other", "the receiver answered HTTP 503", retry_at=later)
    stored = await outbox.get(delivery_id)
    assert stored is not None
    assert (stored.claimed_by, stored.last_error, stored.next_attempt_at) == (
        None,
        "the receiver answered HTTP 503",
        later,
    )
    assert await outbox.claim("other", 5, 30) == []  # not due before ``later``


async def test_a_renewed_claim_outlasts_its_first_lease(outbox: InspectableOutbox) -> None:
    await queue(outbox)
    (held,) = await outbox.claim("w", 5, 1)
    await outbox.renew([held], "w", 60)

    assert await outbox.claim("other", 5, 30, now=utcnow() + timedelta(seconds=30)) == []


async def test_a_delivery_made_is_recorded_even_after_its_claim_lapsed_and_then_never_claimed(
    outbox: InspectableOutbox,
) -> None:
    await queue(outbox)
    (slow,) = await outbox.claim("slow", 5, 30)
    (again,) = await outbox.claim("other", 5, 30, now=utcnow() + timedelta(seconds=31))

    assert await outbox.delivered(slow, "slow")
    assert not await outbox.delivered(again, "other")  # made once already: recorded once
    assert not await outbox.failed(again, "other", "x", retry_at=None)
    stored = await outbox.get(slow.id)
    assert stored is not None and stored.delivered_at is not None and stored.given_up_at is None
    assert await outbox.claim("any", 5, 30, now=utcnow() + timedelta(days=1)) == []
    assert await outbox.pending_count() == 0


async def test_given_up_and_released_deliveries(outbox: InspectableOutbox) -> None:
    first, second = await queue(outbox, 2)
    a, b = await outbox.claim("w", 5, 30)

    assert await outbox.failed(a, "w", "refused: host x is a private address", retry_at=None)
    assert await outbox.release([b], "w") == 1
    (again,) = await outbox.claim("w2", 5, 30)

    assert (again.id, again.attempts) == (second, 2)
    given_up = await outbox.get(first)
    assert given_up is not None and given_up.given_up_at is not None and given_up.delivered_at is None
    assert await outbox.pending_count() == 1


async def test_next_due_tells_when_to_look_again(outbox: InspectableOutbox, database: Database) -> None:
    assert await outbox.next_due() is None
    (delivery_id,) = await queue(outbox)
    soon = utcnow() + timedelta(seconds=5)
    async with database.sessionmaker.begin() as session:
        await session.execute(
            update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(next_attempt_at=soon)
        )
    assert await outbox.next_due() == soon
    await outbox.claim("w", 1, 60, now=soon)
    due = await outbox.next_due()
    assert due is not None and due > soon + timedelta(seconds=59)


async def test_prune_deletes_only_what_was_made_or_given_up_before(outbox: InspectableOutbox) -> None:
    made, given_up, pending = await queue(outbox, 3)
    a, b, _ = await outbox.claim("w", 3, 30)
    await outbox.delivered(a, "w")
    await outbox.failed(b, "w", "x", retry_at=None)

    assert await outbox.prune(utcnow() - timedelta(seconds=60)) == 0
    assert await outbox.prune(utcnow() + timedelta(seconds=1)) == 2
    assert [await outbox.get(i) is not None for i in (made, given_up, pending)] == [False, False, True]


async def test_prune_deletes_up_to_its_limit_a_call_through_an_index_of_each_kind(
    outbox: InspectableOutbox, database: Database
) -> None:
    await queue(outbox, 5)
    claimed = await outbox.claim("w", 5, 30)
    for made in claimed[:3]:
        await outbox.delivered(made, "w")
    for given_up in claimed[3:]:
        await outbox.failed(given_up, "w", "x", retry_at=None)
    later = utcnow() + timedelta(seconds=1)

    assert [await outbox.prune(later, limit=2) for _ in range(4)] == [2, 2, 1, 0]
    assert await outbox.pending_count() == 0

    # Each of the prune's selections is a range of an index, not a scan of the table (PostgreSQL
    # told to avoid scans: on a table this small it would rather scan).
    for done_at, index in (
        (WebhookDelivery.delivered_at, "ix_webhook_deliveries_delivered_at"),
        (WebhookDelivery.given_up_at, "ix_webhook_deliveries_given_up_at"),
    ):
        async with database.sessionmaker.begin() as session:
            conn = await session.connection()
            sqlite = conn.dialect.name == "sqlite"
            if not sqlite:
                await conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            compiled = _prunable(done_at, later, 500).compile(dialect=conn.dialect)
            values = compiled.construct_params()
            params = tuple(values[name] for name in compiled.positiontup or ())
            explain = "EXPLAIN QUERY PLAN " if sqlite else "EXPLAIN "
            rows = await conn.exec_driver_sql(explain + str(compiled), params)
            plan = " ".join(str(row[-1]) for row in rows)
        assert index in plan and "Seq Scan" not in plan, plan


async def test_a_claim_skips_the_hosts_it_is_told_and_a_claim_handed_back_counts_no_attempt(
    outbox: InspectableOutbox, database: Database
) -> None:
    slow = await queue(outbox, 3, "https://Slow.example.com./in")
    (fast,) = await queue(outbox, 1, "https://fast.example.com/in")
    hosts = [d.host for i in (*slow, fast) if (d := await outbox.get(i)) is not None]
    assert hosts == ["slow.example.com"] * 3 + ["fast.example.com"]  # lower case, no trailing dot

    assert await outbox.next_due(skip_hosts={"slow.example.com", "fast.example.com"}) is None
    (only,) = await outbox.claim("w", 10, 30, skip_hosts={"slow.example.com"})
    assert only.id == fast
    first, *over = await outbox.claim("w", 10, 30)
    assert [first.id, *(d.id for d in over)] == slow

    assert await outbox.hand_back(over, "w") == 2
    assert not await outbox.hand_back(over, "w")  # not held any more: nothing
    for delivery_id in slow[1:]:
        back = await outbox.get(delivery_id)
        assert back is not None and (back.claimed_by, back.claimed_until, back.attempts) == (None, None, 0)
    again = await outbox.claim("w2", 10, 30)
    assert [(d.id, d.attempts) for d in again] == [(i, 1) for i in slow[1:]]

    # A row stored without its host (before revision 0011) is told by its URL, and handed back
    # gets it stored: skipped from then on.
    (old,) = await queue(outbox, 1, "https://old.example.com/in")
    async with database.sessionmaker.begin() as session:
        await session.execute(update(WebhookDelivery).where(WebhookDelivery.id == old).values(host=None))
    (legacy,) = await outbox.claim("w", 10, 30, skip_hosts={"old.example.com"})
    assert legacy.host == "old.example.com"
    assert await outbox.hand_back([legacy], "w") == 1
    assert await outbox.claim("w", 10, 30, skip_hosts={"old.example.com"}) == []
    stored = await outbox.get(old)
    assert stored is not None and stored.attempts == 0


# ---- push configs --------------------------------------------------------------------------


async def test_push_configs_belong_to_the_runs_owner_and_go_with_the_run(
    database: Database, runs: RunRepo, conv: ConversationRecord
) -> None:
    configs = PushConfigRepo(database.sessionmaker)
    run = await start(runs, conv)
    first = NewPushConfig("c1", "https://a.example/p", "t1", {"scheme": "Bearer", "credentials": "x"})

    stored = await configs.create("alice", run.id, first)
    assert await configs.create("bob", run.id, first) is None
    assert await configs.create("alice", "run_missing", first) is None

    assert stored is not None and (stored.config_id, stored.token, stored.authentication) == (
        "c1",
        "t1",
        {"scheme": "Bearer", "credentials": "x"},
    )
    replaced = await configs.create("alice", run.id, NewPushConfig("c1", "https://b.example/p"))
    await configs.create("alice", run.id, NewPushConfig("c2", "https://c.example/p"))
    assert replaced is not None and (replaced.url, replaced.token) == ("https://b.example/p", None)
    assert [c.config_id for c in await configs.list_configs("alice", run.id)] == ["c1", "c2"]
    assert await configs.list_configs("bob", run.id) == []
    assert await configs.get("bob", run.id, "c1") is None
    assert not await configs.delete("bob", run.id, "c1")
    assert await configs.delete("alice", run.id, "c1")
    assert [c.config_id for c in await configs.list_configs("alice", run.id)] == ["c2"]

    await ConversationRepo(database.sessionmaker).delete("alice", conv.id)
    assert await configs.list_configs("alice", run.id) == []


async def test_deliveries_owed_outlive_the_conversation_they_tell_of(
    database: Database, runs: RunRepo, outbox: InspectableOutbox, conv: ConversationRecord
) -> None:
    run = await start(runs, conv, webhook=HOOK)
    await finish(runs, run)

    await ConversationRepo(database.sessionmaker).delete("alice", conv.id)

    assert [d.event for d in await outbox.of_run(run.id)] == ["completed"]
    assert await runs.get_any(run.id) is None


async def test_a_cancel_of_a_waiting_run_is_closed_by_the_claim_with_its_webhook(
    database: Database,
    runs: RunRepo,
    outbox: InspectableOutbox,
    conv: ConversationRecord,
    notices: OutboxNotices,
) -> None:
    approvals = ApprovalRepo(database.sessionmaker, notices)
    run = await start(runs, conv, webhook=HOOK)
    expires = datetime(2099, 1, 1, tzinfo=UTC)
    await approvals.request(
        NewApproval("apr_1", run.id, conv.id, "alice", "c1", "calculator", {}, 1, expires)
    )
    assert await approvals.park(run.id, 1, "w1") == "waiting"
    assert await runs.request_cancel(run.id)
    async with database.sessionmaker.begin() as session:  # as the claim takes it, attempt 2
        await session.execute(update(Run).where(Run.id == run.id).values(attempt=2, worker_id="w2"))

    assert await finish(runs, run, "cancelled", attempt=2)

    events = [(d.event, orjson.loads(d.body)["status"]) for d in await outbox.of_run(run.id)]
    assert events == [("waiting", "waiting"), ("cancelled", "cancelled")]


async def test_a_waiting_run_that_goes_on_tells_its_push_configs_it_works_but_not_its_webhook(
    database: Database,
    runs: RunRepo,
    outbox: InspectableOutbox,
    conv: ConversationRecord,
    notices: OutboxNotices,
) -> None:
    approvals = ApprovalRepo(database.sessionmaker, notices)
    pushed = await start(runs, conv, webhook=HOOK, push_configs=[NewPushConfig("c", "https://p.example/a2a")])
    expires = datetime(2099, 1, 1, tzinfo=UTC)
    found = await approvals.request(
        NewApproval("apr_1", pushed.id, conv.id, "alice", "c1", "calculator", {}, 1, expires)
    )
    assert await approvals.park(pushed.id, 1, "w1") == "waiting"

    _, goes_on = await approvals.decide(
        found, status="approved", reason=None, decided_args={}, decided_by="alice"
    )

    assert goes_on
    owed = [(d.kind, d.event) for d in await outbox.of_run(pushed.id)]
    assert owed == [("run", "waiting"), ("a2a_push", "waiting"), ("a2a_push", "running")]
    working = orjson.loads((await outbox.of_run(pushed.id))[-1].body)["statusUpdate"]
    assert working["status"]["state"] == "TASK_STATE_WORKING" and "message" not in working["status"]

    # An expiry that lets a run go on tells it too; a run with a webhook alone is told nothing.
    other = await ConversationRepo(database.sessionmaker).create("alice", "other", {})
    quiet = await start(runs, other, webhook=HOOK)
    soon = utcnow() + timedelta(milliseconds=1)
    await approvals.request(
        NewApproval("apr_2", quiet.id, other.id, "alice", "c2", "calculator", {}, 1, soon)
    )
    assert await approvals.park(quiet.id, 1, "w1") == "waiting"
    assert await approvals.expire_due(utcnow() + timedelta(seconds=1)) == (1, [quiet.id])
    assert [d.event for d in await outbox.of_run(quiet.id)] == ["waiting"]
