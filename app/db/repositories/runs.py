"""``RunRepo``: runs, their start and close, and their leases."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn

from sqlalchemy import bindparam, case, delete, exists, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import ConversationNotFoundError, EventIdTakenError, RunActiveError
from app.db.models import (
    ACTIVE_STATUSES,
    RUN_STATUSES,
    Approval,
    Conversation,
    Run,
    ToolEffect,
    utcnow,
)
from app.db.repositories.push_configs import NewPushConfig, has_push_configs
from app.db.repositories.queue import Admission, NearBound, start_exclusive
from app.db.repositories.rows import (
    FINAL_STATUSES,
    RunRecord,
    _append_messages,
    _checkpoints,
    _delete_follow_ups,
    _event_row,
    _holds,
    _insert_events,
    _lock_conversation,
    _messages_of,
    _run_record,
    _runs,
    new_run_id,
    path_to,
)
from app.db.repositories.run_notices import NOTIFY, RunNotices
from app.db.repositories.run_start import UNDER_HEAD, Opening, Placement, insert_start
from app.db.session import read_sessions
from app.llm.base import ChatMessage
from app.streaming.bus import StoredEvent

_RUN = select(_runs).where(_runs.c.id == bindparam("b_id"))
_RUN_OF_OWNER = _RUN.where(_runs.c.owner == bindparam("b_owner"))
_ACTIVE_RUN = select(_runs).where(
    _runs.c.conversation_id == bindparam("b_conversation"), _runs.c.status.in_(ACTIVE_STATUSES)
)
_LATEST_RUN = (
    select(_runs)
    .where(_runs.c.conversation_id == bindparam("b_conversation"))
    .order_by(_runs.c.created_at.desc(), _runs.c.id.desc())
    .limit(1)
)
# A close says where the run's messages go (below its question, FACES.md B-01), and whether
# anyone is to be told of it (a webhook, a push config: N-06, N-07).
_FINISH_RUN = (
    update(_runs)
    .where(_runs.c.id == bindparam("b_id"), _runs.c.status == "running")
    .returning(_runs.c.question_seq, NOTIFY)
)
_FINISH_ATTEMPT = _FINISH_RUN.where(_runs.c.attempt == bindparam("b_attempt"))
_QUESTION_OF = select(_runs.c.question_seq).where(_runs.c.id == bindparam("b_id"))
_CHECKPOINTS = (
    select(_checkpoints.c.seq, _checkpoints.c.after, _checkpoints.c.data)
    .where(_checkpoints.c.run_id == bindparam("b_run"), _checkpoints.c.attempt == bindparam("b_attempt"))
    .order_by(_checkpoints.c.seq)
)


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """One stored checkpoint of a run: its place, the last event it covers, its JSON text."""

    seq: int
    after: str | None
    data: str


START_ID_ATTEMPTS = 3
"""How many times a start stamps its first events (a replay's, a queued phase) anew when another
process stored an event under one of their ids (the start kept nothing then)."""


class RunRepo:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], notices: RunNotices | None = None
    ) -> None:
        """``notices``: told of each close in its transaction, when the run has listeners (the
        webhooks' outbox); None: nobody is told (tests of the runs alone)."""
        self._sessionmaker = sessionmaker
        self._reads = read_sessions(sessionmaker)  # a run by id or the conversation's active one
        self._notices = notices

    @staticmethod
    def _new_row(
        conversation_id: str,
        owner: str,
        message: str,
        worker_id: str,
        lease_s: float,
        start_cursor: str,
        model: str | None = None,
        trace_parent: str | None = None,
        webhook: str | None = None,
    ) -> dict[str, Any]:
        now = utcnow()
        return {
            "id": new_run_id(),
            "conversation_id": conversation_id,
            "owner": owner,
            "status": "running",
            "message": message,
            "answer": None,
            "iterations": 0,
            "usage": {},
            "elapsed": None,
            "error": None,
            "pending_injections": [],
            "start_cursor": start_cursor,
            "worker_id": worker_id,
            "lease_expires_at": now + timedelta(seconds=lease_s),
            "created_at": now,
            "finished_at": None,
            "attempt": 1,
            "lost_attempts": 0,
            "cancel_requested": False,
            "model": model,
            # ``00-<trace id>-<span id>-<flags>``: the trace the run's spans belong to, and their parent.
            "trace_id": trace_parent[3:35] if trace_parent else None,
            "trace_parent": trace_parent,
            "webhook": webhook,
        }

    async def _explain_conflict(self, conversation_id: str) -> NoReturn:
        """After an IntegrityError inserting a run: run ids are random, so the insert can only
        break the foreign key or the one-running-run index; which one is told apart without
        parsing driver messages."""
        async with self._sessionmaker() as session:
            exists = await session.scalar(select(Conversation.id).where(Conversation.id == conversation_id))
        if exists is None:
            raise ConversationNotFoundError(conversation_id) from None
        raise RunActiveError(conversation_id) from None

    async def start(
        self,
        conversation_id: str,
        owner: str,
        message: str,
        *,
        worker_id: str,
        lease_s: float,
        start_cursor: str,
        prior: Sequence[ChatMessage] = (),
        model: str | None = None,
        trace_parent: str | None = None,
        admission: Admission | None = None,
        queued_event: Callable[[str, str, int], StoredEvent] | None = None,
        placement: Placement = UNDER_HEAD,
        client_tools: list[dict[str, Any]] | None = None,
        opening: Callable[[str, str], Opening] | None = None,
        replay_of: str | None = None,
        webhook: str | None = None,
        push_configs: Sequence[NewPushConfig] = (),
    ) -> tuple[RunRecord, list[ChatMessage]]:
        """Insert a running run leased to ``worker_id`` and, in the same transaction, store
        ``prior`` turns (a whole chat sent at once), read the conversation's history, then store
        the question: one write, and a history that is exactly what came before this run.
        Returns the run and that history.

        The run's ``start_cursor`` is the later of ``start_cursor`` (what the bus held) and the
        conversation's last stored event, read after the insert: a previous run's ``done`` is
        stored in the transaction that closed it (``finish``), and this insert can only succeed
        once that close is committed, so the new run's events come after that done, however
        late the done reaches the bus.

        With an ``admission`` the run may queue instead (RUNS.md Q-01; ``queue.admit``): its row
        is then ``queued``, held by nobody, and ``queued_event(run_id, after, position)``, its
        ``queued`` phase, is stored with it.

        ``placement`` says where the question goes in the conversation's tree; ``opening(run_id,
        after)``, the events and first checkpoint of a run that starts from another's checkpoint
        (stamped after cursor ``after``), stored with it. ``webhook``: the URL the run's record is
        posted to when it waits and when it ends (FACES.md N-07); ``push_configs``: A2A push
        notification configs of the new task (N-06), stored with it, so that none of its changes
        can come before them.

        Raises ``RunActiveError`` if a run of the conversation is active (the partial unique index
        decides, so of two concurrent starts exactly one wins), ``ConversationNotFoundError`` if
        the conversation does not exist, and ``QueueFullError`` if the run would queue but the
        queue is full (Q-02); nothing is stored then.
        """
        # A start near the queue's bound is made again, counting alone (check_bound).
        bind = self._sessionmaker.kw.get("bind")
        exclusive_first = admission is not None and start_exclusive(bind, admission.max_queued)
        tries = (True,) if exclusive_first else (False, True)
        for exclusive in tries:
            row = self._new_row(
                conversation_id,
                owner,
                message,
                worker_id,
                lease_s,
                start_cursor,
                model=model,
                trace_parent=trace_parent,
                webhook=webhook,
            )
            row.update(client_tools=client_tools, replay_of=replay_of)
            fresh = dict(row)
            for _ in range(START_ID_ATTEMPTS):
                row = dict(fresh)
                try:
                    async with self._sessionmaker.begin() as session:
                        history = await insert_start(
                            session,
                            row,
                            prior,
                            admission,
                            queued_event,
                            placement,
                            opening,
                            exclusive=exclusive,
                            push_configs=push_configs,
                        )
                except EventIdTakenError:
                    continue  # another process stored an event under an id stamped here: stamp anew
                except NearBound:
                    break
                except IntegrityError:
                    await self._explain_conflict(conversation_id)
                return RunRecord(**row), history
            else:
                raise EventIdTakenError("the ids of the run's first events kept being taken")
        raise AssertionError("an exclusive check_bound does not raise NearBound")

    async def get(self, owner: str, run_id: str) -> RunRecord | None:
        """The run if ``owner`` owns it; None otherwise."""
        return await self._one(_RUN_OF_OWNER, {"b_id": run_id, "b_owner": owner})

    async def get_any(self, run_id: str) -> RunRecord | None:
        return await self._one(_RUN, {"b_id": run_id})

    async def active(self, conversation_id: str) -> RunRecord | None:
        return await self._one(_ACTIVE_RUN, {"b_conversation": conversation_id})

    async def latest(self, conversation_id: str) -> RunRecord | None:
        return await self._one(_LATEST_RUN, {"b_conversation": conversation_id})

    async def finish(
        self,
        run_id: str,
        *,
        status: str,
        answer: str,
        iterations: int,
        usage: dict[str, Any],
        elapsed: float,
        error: str | None,
        pending_injections: list[str],
        messages: Sequence[ChatMessage] = (),
        conversation_id: str | None = None,
        done: StoredEvent | None = None,
        attempt: int | None = None,
        follow_ups_through: int | None = None,
    ) -> bool:
        """Close the run if it is still running (in ``attempt``, when given: an attempt that lost
        the run to another one cannot close it); False if someone else closed it first.

        ``messages`` (what the run added to conversation ``conversation_id``) are stored in the
        same transaction, whether or not the run was still running. ``done`` (the run's last
        event, from ``RunPublisher.stamp``) is stored with the close, so that a closed run always
        has its done in the log and the next run of the conversation starts after it
        (``start``). A retry of a close whose commit went through but whose answer was lost
        finds its very done stored (same id, same bytes) and returns True again; another closer's
        done, even under the same id, does not count. Raises ``EventIdTakenError``, keeping
        nothing, if the run was open but another event holds the done's id. The run's listeners
        (webhook, push configs) get their deliveries in the same transaction (``RunNotices``).
        """
        if status not in FINAL_STATUSES:
            raise ValueError(f"a run cannot finish as {status!r}")
        if (messages or done is not None) and conversation_id is None:
            raise ValueError("messages and done need their conversation_id")
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                _FINISH_RUN if attempt is None else _FINISH_ATTEMPT,
                {
                    "b_id": run_id,
                    "b_attempt": attempt,
                    "status": status,
                    "answer": answer,
                    "iterations": iterations,
                    "usage": usage,
                    "elapsed": elapsed,
                    "error": error,
                    "pending_injections": list(pending_injections),
                    "lease_expires_at": None,
                    "finished_at": utcnow(),
                },
            )
            finished = result.first()
            closed = finished is not None
            if conversation_id is not None:
                if done is not None and not closed and await _holds(session, conversation_id, done):
                    return True  # this very close, committed by an earlier attempt
                if messages and (closed or attempt is None):
                    # An attempt that lost the run adds nothing to the conversation: the attempt
                    # that holds it adds its own, below its question (and the conversation's
                    # current leaf moves with them while it is there).
                    question = (
                        finished.question_seq
                        if finished is not None
                        else await session.scalar(_QUESTION_OF, {"b_id": run_id})
                    )
                    if question is None:  # a run older than trees: below the current leaf
                        question = await _lock_conversation(session, conversation_id)
                    await _append_messages(
                        session, conversation_id, run_id, messages, parent_seq=question, head_from=question
                    )
                if closed and follow_ups_through is not None:
                    await _delete_follow_ups(session, conversation_id, follow_ups_through)
                if (
                    done is not None
                    and closed
                    and not await _insert_events(session, [_event_row(conversation_id, done)])
                ):
                    # Another process stored an event under this id: a close without its done in
                    # the log would leave readers waiting. Undo it all; the caller restamps.
                    raise EventIdTakenError(done.id)
            if (
                finished is not None
                and self._notices is not None
                # RETURNING's NOTIFY may predate a push config committed while the row was waited
                # for (PostgreSQL): asked again, with the row held (``has_push_configs``).
                and (finished.notify or await has_push_configs(session, run_id))
            ):
                await self._notices.run_changed(session, run_id)
        return closed

    async def renew_leases(self, run_ids: Sequence[str], worker_id: str, lease_s: float) -> None:
        """Extend the leases of those of ``run_ids`` still running on ``worker_id``."""
        if not run_ids:
            return
        async with self._sessionmaker.begin() as session:
            await session.execute(
                update(Run)
                .where(Run.id.in_(list(run_ids)), Run.worker_id == worker_id, Run.status == "running")
                .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            )

    async def claimable(
        self, worker_id: str, *, held_by: Sequence[str] = (), now: datetime | None = None
    ) -> list[RunRecord]:
        """Running runs that no live worker may hold, oldest first: released by their worker (none
        holds them), their lease ran out (before ``now``), or held by one of ``held_by`` (workers
        the caller knows are gone). Never ``worker_id``'s own."""
        now = now if now is not None else utcnow()
        free = or_(Run.worker_id.is_(None), Run.lease_expires_at < now)
        if held_by:
            free = or_(free, Run.worker_id.in_(list(held_by)))
        return await self._all(
            select(Run)
            .where(Run.status == "running", free, or_(Run.worker_id.is_(None), Run.worker_id != worker_id))
            .order_by(Run.created_at)
        )

    async def holders(self, prefix: str) -> list[str]:
        """The workers whose ids start with ``prefix`` (this host's) that hold running runs."""
        async with self._sessionmaker() as session:
            rows = await session.scalars(
                select(Run.worker_id)
                .where(Run.status == "running", Run.worker_id.startswith(prefix, autoescape=True))
                .distinct()
            )
            return [worker for worker in rows if worker is not None]

    async def claim(
        self,
        run: RunRecord,
        worker_id: str,
        lease_s: float,
        *,
        lost: bool,
        holder_dead: bool = False,
        first: CheckpointRow | None = None,
    ) -> RunRecord | None:
        """Take ``run`` for a new attempt on ``worker_id`` if it is still as the caller saw it (same
        attempt, same holder, and, unless ``holder_dead``, a lease that ran out); None if another
        worker took it first or its holder came back.

        ``lost``: its last attempt died (RUNS.md R-07 counts it). In the same transaction the new
        attempt's first checkpoint is stored: ``first``, the state the last attempt's checkpoints
        fold into (the caller read them), so that what that attempt may still write later counts
        for nothing.
        """
        now = utcnow()
        condition = [Run.id == run.id, Run.status == "running", Run.attempt == run.attempt]
        if run.worker_id is None:
            condition.append(Run.worker_id.is_(None))
        else:
            condition.append(Run.worker_id == run.worker_id)
            if not holder_dead:
                condition.append(Run.lease_expires_at < now)
        attempt = run.attempt + 1
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(Run)
                .where(*condition)
                .values(
                    attempt=attempt,
                    worker_id=worker_id,
                    lease_expires_at=now + timedelta(seconds=lease_s),
                    lost_attempts=run.lost_attempts + (1 if lost else 0),
                )
            )
            if not result.rowcount:  # type: ignore[attr-defined]
                return None
            claimed = _run_record((await session.execute(_RUN, {"b_id": run.id})).one())
            if first is not None:
                await session.execute(
                    insert(_checkpoints),
                    {
                        "run_id": run.id,
                        "attempt": attempt,
                        "seq": 0,
                        "after": first.after,
                        "data": first.data,
                        "created_at": now,
                    },
                )
        return claimed

    async def all_checkpoints(self, run_id: str) -> list[tuple[int, CheckpointRow]]:
        """Every checkpoint of every attempt of the run, in order, with its attempt (B-06)."""
        query = (
            select(_checkpoints.c.attempt, _checkpoints.c.seq, _checkpoints.c.after, _checkpoints.c.data)
            .where(_checkpoints.c.run_id == run_id)
            .order_by(_checkpoints.c.attempt, _checkpoints.c.seq)
        )
        async with self._sessionmaker() as session:
            rows = await session.execute(query)
            return [(row.attempt, CheckpointRow(row.seq, row.after, row.data)) for row in rows]

    async def checkpoints(self, run_id: str, attempt: int) -> list[CheckpointRow]:
        async with self._sessionmaker() as session:
            rows = await session.execute(_CHECKPOINTS, {"b_run": run_id, "b_attempt": attempt})
            return [CheckpointRow(row.seq, row.after, row.data) for row in rows]

    async def release(self, run_id: str, attempt: int, worker_id: str, *, lost: bool = False) -> bool:
        """Let the run go (a worker that stops hands it over, RUNS.md R-08): it stays running, held
        by nobody, for any worker to claim at once. False if ``attempt`` no longer holds it.
        ``lost``: the attempt failed (it counts toward RUN_MAX_ATTEMPTS, R-07)."""
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                update(Run)
                .where(
                    Run.id == run_id,
                    Run.status == "running",
                    Run.attempt == attempt,
                    Run.worker_id == worker_id,
                )
                .values(
                    worker_id=None,
                    lease_expires_at=None,
                    lost_attempts=Run.lost_attempts + (1 if lost else 0),
                )
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def request_cancel(self, run_id: str) -> bool:
        """Mark a running run for cancel, for whichever worker holds it next (RUNS.md R-11). A
        waiting run's approvals close with it (A-05); a waiting or queued run becomes a running run
        that no worker holds, which the next claim closes."""
        unheld = Run.status.in_(("queued", "waiting"))
        async with self._sessionmaker.begin() as session:
            # One statement for every active status: a worker taking the queued run from the queue,
            # or a decision letting the waiting run go on, may hold its row at this moment; this
            # update then applies to the running run they made of it.
            result = await session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status.in_(("running", "queued", "waiting")))
                .values(
                    cancel_requested=True,
                    status="running",
                    worker_id=case((unheld, None), else_=Run.worker_id),
                    lease_expires_at=case((unheld, None), else_=Run.lease_expires_at),
                    # Never started: the claim that closes it is its first attempt.
                    attempt=case((Run.status == "queued", Run.attempt - 1), else_=Run.attempt),
                )
            )
            if not result.rowcount:  # type: ignore[attr-defined]
                return False
            # Its open approvals close with it (a running run asking for one finds, when it would
            # wait, that it was cancelled).
            await session.execute(
                update(Approval)
                .where(Approval.run_id == run_id, Approval.status == "pending")
                .values(status="cancelled", reason="the run was cancelled", decided_at=utcnow())
            )
        return True

    async def history_before(self, run: RunRecord) -> list[ChatMessage]:
        """The path of the conversation's tree to ``run``'s question, the question left out: the
        history it started with (FACES.md B-01)."""
        async with self._sessionmaker() as session:
            records = await _messages_of(session, run.conversation_id)
        if run.question_seq is not None:
            parent = next((r.parent_seq for r in records if r.seq == run.question_seq), None)
            return [r.to_chat_message() for r in path_to(records, parent)]
        # A run older than trees whose question is gone: what came before its first message.
        first = min((r.seq for r in records if r.run_id == run.id), default=None)
        return [r.to_chat_message() for r in records if first is None or r.seq < first]

    async def prune(
        self, finished_before: datetime | None, effects_before: datetime, *, limit: int = 500
    ) -> int:
        """Delete what finished runs no longer need: the checkpoints of runs that finished before
        ``finished_before`` (None: none) and the tool effects recorded before ``effects_before``
        (RUNS.md R-05, R-12: a key is only asked again by an attempt of a run that is still
        active). Returns how many rows went."""
        async with self._sessionmaker.begin() as session:
            runs: list[str] = []
            if finished_before is not None:
                done = (
                    select(Run.id)
                    .where(Run.status.in_(sorted(FINAL_STATUSES)), Run.finished_at < finished_before)
                    .where(exists().where(_checkpoints.c.run_id == Run.id))
                    .limit(limit)
                )
                runs = list(await session.scalars(done))
            gone = 0
            if runs:
                result = await session.execute(delete(_checkpoints).where(_checkpoints.c.run_id.in_(runs)))
                gone += result.rowcount  # type: ignore[attr-defined]
            old = (
                select(ToolEffect.idempotency_key).where(ToolEffect.created_at < effects_before).limit(limit)
            )
            keys = list(await session.scalars(old))
            if keys:
                result = await session.execute(delete(ToolEffect).where(ToolEffect.idempotency_key.in_(keys)))
                gone += result.rowcount  # type: ignore[attr-defined]
        return int(gone)

    async def running_of_worker(self, worker_id: str) -> list[RunRecord]:
        return await self._all(
            select(Run).where(Run.status == "running", Run.worker_id == worker_id).order_by(Run.created_at)
        )

    async def counts_by_status(self) -> dict[str, int]:
        """Number of runs per status, every status present (zero included)."""
        counts = dict.fromkeys(RUN_STATUSES, 0)
        async with self._sessionmaker() as session:
            for status, count in await session.execute(select(Run.status, func.count()).group_by(Run.status)):
                counts[status] = count
        return counts

    async def _one(self, query: Any, params: dict[str, Any]) -> RunRecord | None:
        async with self._reads() as session:
            row = (await session.execute(query, params)).first()
        return _run_record(row) if row is not None else None

    async def _all(self, query: Any) -> list[RunRecord]:
        async with self._sessionmaker() as session:
            return [_run_record(row) for row in await session.scalars(query)]
