"""Approvals in the database (RUNS.md A-02..A-05) against real SQLite and PostgreSQL: a run parks and
goes on exactly when its last approval is decided or expires, whichever of the park and the decision
commits first; the first decision stands under a race; an approval of a run that ended is closed."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from app.db.models import utcnow
from app.db.repositories import ConversationRepo, RunRecord, RunRepo
from app.db.repositories.approvals import ApprovalClosedError, ApprovalRepo, NewApproval
from app.db.session import Database
from app.runs.approvals import APPROVAL_ID, approval_id


@pytest.fixture
def runs(database: Database) -> RunRepo:
    return RunRepo(database.sessionmaker)


@pytest.fixture
def approvals(database: Database) -> ApprovalRepo:
    return ApprovalRepo(database.sessionmaker)


async def running_run(database: Database, runs: RunRepo) -> RunRecord:
    conv = await ConversationRepo(database.sessionmaker).create("alice", "approvals", {})
    run, _ = await runs.start(conv.id, "alice", "q", worker_id="w1", lease_s=30, start_cursor="0-0")
    return run


def new(run: RunRecord, call_id: str, *, expires_in: float = 3600) -> NewApproval:
    return NewApproval(
        id=approval_id(run.id, call_id, "send", {"to": "bob"}),
        run_id=run.id,
        conversation_id=run.conversation_id,
        owner="alice",
        call_id=call_id,
        tool_name="send",
        tool_args={"to": "bob"},
        iteration=1,
        expires_at=utcnow() + timedelta(seconds=expires_in),
    )


async def status_of(runs: RunRepo, run: RunRecord) -> tuple[str, str | None]:
    row = await runs.get_any(run.id)
    assert row is not None
    return row.status, row.worker_id


def test_an_approval_id_is_the_same_for_the_same_call_and_differs_for_any_other() -> None:
    one = approval_id("run_1", "call_1", "send", {"to": "bob", "cc": "ann"})
    assert APPROVAL_ID.fullmatch(one)
    assert one == approval_id("run_1", "call_1", "send", {"cc": "ann", "to": "bob"})
    others = {
        approval_id("run_2", "call_1", "send", {"to": "bob", "cc": "ann"}),
        approval_id("run_1", "call_2", "send", {"to": "bob", "cc": "ann"}),
        approval_id("run_1", "call_1", "delete", {"to": "bob", "cc": "ann"}),
        approval_id("run_1", "call_1", "send", {"to": "eve", "cc": "ann"}),
    }
    assert one not in others and len(others) == 4


async def test_a_run_waits_while_an_approval_is_pending_and_goes_on_with_the_last_decision(
    database: Database, runs: RunRepo, approvals: ApprovalRepo
) -> None:
    run = await running_run(database, runs)
    first, second = await approvals.request(new(run, "c1")), await approvals.request(new(run, "c2"))
    assert await approvals.request(new(run, "c1")) == first  # asked again: the same approval

    assert await approvals.park(run.id, run.attempt, "w1") == "waiting"
    assert await status_of(runs, run) == ("waiting", None)
    _, goes_on = await approvals.decide(
        first, status="approved", reason=None, decided_args={"to": "ann"}, decided_by="alice"
    )
    assert not goes_on and (await status_of(runs, run))[0] == "waiting"
    decided, goes_on = await approvals.decide(
        second, status="denied", reason="no", decided_args=second.tool_args, decided_by="alice"
    )

    assert goes_on and decided.status == "denied" and decided.reason == "no" and decided.decided_by == "alice"
    assert await status_of(runs, run) == ("running", None)  # held by nobody: any claim loop takes it
    with pytest.raises(ApprovalClosedError):
        await approvals.decide(first, status="denied", reason=None, decided_args={}, decided_by="alice")
    assert [(a.call_id, a.status, a.decided_args) for a in await approvals.of_run(run.id)] == [
        ("c1", "approved", {"to": "ann"}),
        ("c2", "denied", {"to": "bob"}),
    ]


async def test_a_decision_made_before_the_run_parked_lets_the_park_release_it_at_once(
    database: Database, runs: RunRepo, approvals: ApprovalRepo
) -> None:
    run = await running_run(database, runs)
    only = await approvals.request(new(run, "c1"))
    _, goes_on = await approvals.decide(
        only, status="approved", reason=None, decided_args={}, decided_by="alice"
    )
    assert not goes_on  # the run is still running: nothing to wake

    assert await approvals.park(run.id, run.attempt, "w1") == "released"
    assert await status_of(runs, run) == ("running", None)


@pytest.mark.parametrize("rounds", [6])
async def test_a_park_and_the_last_decision_at_the_same_moment_never_leave_the_run_waiting(
    database: Database, migrated_database_url: str, runs: RunRepo, approvals: ApprovalRepo, rounds: int
) -> None:
    other = Database(migrated_database_url)
    try:
        racing = ApprovalRepo(other.sessionmaker)
        for _ in range(rounds):
            run = await running_run(database, runs)
            only = await approvals.request(new(run, "c1"))
            parked, (_, goes_on) = await asyncio.gather(
                approvals.park(run.id, run.attempt, "w1"),
                racing.decide(only, status="approved", reason=None, decided_args={}, decided_by="alice"),
            )
            assert parked in ("waiting", "released")
            assert await status_of(runs, run) == ("running", None), (parked, goes_on)
            assert (parked == "released") != goes_on  # exactly one of the two let it go
    finally:
        await other.dispose()


async def test_of_two_decisions_at_the_same_moment_exactly_one_stands(
    database: Database, migrated_database_url: str, runs: RunRepo, approvals: ApprovalRepo
) -> None:
    other = Database(migrated_database_url)
    try:
        run = await running_run(database, runs)
        only = await approvals.request(new(run, "c1"))
        await approvals.park(run.id, run.attempt, "w1")
        results = await asyncio.gather(
            approvals.decide(only, status="approved", reason=None, decided_args={}, decided_by="alice"),
            ApprovalRepo(other.sessionmaker).decide(
                only, status="denied", reason="x", decided_args={}, decided_by="alice"
            ),
            return_exceptions=True,
        )
    finally:
        await other.dispose()
    closed = [r for r in results if isinstance(r, ApprovalClosedError)]
    won = [r for r in results if not isinstance(r, BaseException)]
    assert len(closed) == 1 and len(won) == 1
    assert (await approvals.of_run(run.id))[0].status == won[0][0].status


async def test_an_approval_past_its_time_expires_and_its_run_goes_on(
    database: Database, runs: RunRepo, approvals: ApprovalRepo
) -> None:
    run = await running_run(database, runs)
    due = await approvals.request(new(run, "c1", expires_in=-1))
    await approvals.park(run.id, run.attempt, "w1")
    with pytest.raises(ApprovalClosedError, match="expired"):
        await approvals.decide(due, status="approved", reason=None, decided_args={}, decided_by="alice")

    expired, resumed = await approvals.expire_due()

    assert (expired, resumed) == (1, [run.id])
    assert (await approvals.of_run(run.id))[0].status == "expired"
    assert await status_of(runs, run) == ("running", None)
    assert await approvals.expire_due() == (0, [])


async def test_an_approval_of_a_run_that_ended_is_closed_listed_nowhere_and_tidied_up(
    database: Database, runs: RunRepo, approvals: ApprovalRepo
) -> None:
    run = await running_run(database, runs)
    left = await approvals.request(new(run, "c1"))
    await runs.finish(
        run.id,
        status="cancelled",
        answer="",
        iterations=0,
        usage={},
        elapsed=0.1,
        error=None,
        pending_injections=[],
    )

    with pytest.raises(ApprovalClosedError, match="closed with its run"):
        await approvals.decide(left, status="approved", reason=None, decided_args={}, decided_by="alice")
    assert await approvals.pending(owner="alice") == [] and await approvals.count_pending() == 0
    assert await approvals.close_orphans() == 1
    assert (await approvals.of_run(run.id))[0].status == "cancelled"
    assert await approvals.close_orphans() == 0


async def test_cancelling_a_waiting_run_closes_its_approvals_and_lets_it_go(
    database: Database, runs: RunRepo, approvals: ApprovalRepo
) -> None:
    run = await running_run(database, runs)
    pending = await approvals.request(new(run, "c1"))
    await approvals.park(run.id, run.attempt, "w1")

    assert await runs.request_cancel(run.id)

    row = await runs.get_any(run.id)
    assert row is not None and (row.status, row.worker_id, row.cancel_requested) == ("running", None, True)
    assert (await approvals.of_run(run.id))[0].status == "cancelled"
    with pytest.raises(ApprovalClosedError):
        await approvals.decide(pending, status="approved", reason=None, decided_args={}, decided_by="alice")
    # A park after the cancel was asked for does not park: the caller closes the run.
    run2 = await running_run(database, runs)
    await approvals.request(new(run2, "c1"))
    assert await runs.request_cancel(run2.id)
    assert await approvals.park(run2.id, run2.attempt, "w1") == "cancelled"
    assert await approvals.park(run2.id, run2.attempt, "someone else") == "lost"
