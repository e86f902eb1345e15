"""Leases and takeovers: a run lives on when its worker does not (RUNS.md R-03, R-07, R-08, R-11).

The worker that executes a run renews its lease (``heartbeat_loop``). Every worker looks for runs
that no live worker holds (``claim_loop``): released by a worker that stopped, whose lease ran out,
or held by a process of this host that is gone. It claims such a run for a new attempt, in one
transaction with the checkpoint that attempt starts from, and carries it on; or, when the run was
cancelled meanwhile or its attempts keep dying, closes it with its ``done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import orjson

from app.db.errors import database_unreachable
from app.db.models import utcnow
from app.db.repositories import ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.queue import RunQueue
from app.db.repositories.rows import follow_up_messages
from app.db.repositories.runs import CheckpointRow
from app.engine.events import RunDone
from app.engine.state import RunCheckpoint
from app.observability import Metrics
from app.runs.capacity import Room
from app.runs.closing import (
    close_row,
    close_with_done,
    drain_quietly,
    progress,
)
from app.runs.execution import ActiveRun, CancelReason, Executor, InterruptQueues, Resume
from app.runs.workers import local_host, local_process_gone
from app.settings import Settings
from app.streaming.bus import BusUnavailableError, EventBus, StoredEvent, later_cursor
from app.streaming.store import EventPersistError

log = logging.getLogger("app.runs")

CLAIM_INTERVAL_S = 2.0
"""Longest pause between two looks for runs to take over (a released run is announced at once)."""
PRUNE_INTERVAL_S = 60.0
EFFECTS_KEPT_S = 7 * 86400.0
"""Tool effects (idempotency records) are kept at least this long, and twice APPROVAL_TIMEOUT_S."""


def _deltas(rows: list[CheckpointRow]) -> Iterator[dict[str, Any]]:
    """The checkpoints the rows hold, in order (a row holds one, or a JSON list of a batch's)."""
    for row in rows:
        value = orjson.loads(row.data)
        yield from value if isinstance(value, list) else [value]


class Takeover:
    """The heartbeat and the claim loop of one worker."""

    def __init__(
        self,
        *,
        settings: Settings,
        conversations: ConversationRepo,
        runs: RunRepo,
        leases: RunRepo,
        events: EventRepo,
        bus: EventBus,
        executor: Executor,
        interrupts: InterruptQueues,
        metrics: Metrics,
        worker_id: str,
        active: dict[str, ActiveRun],
        accepting: Callable[[], bool],
        cancel_local: Callable[[ActiveRun, CancelReason], None],
        room: Room | None = None,
        queue: RunQueue | None = None,
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self.runs = runs
        self.leases = leases
        self.events = events
        self.bus = bus
        self.executor = executor
        self.interrupt_queue = interrupts
        self.metrics = metrics
        self.worker_id = worker_id
        self.active = active
        self.accepting = accepting
        self.cancel_local = cancel_local
        self.room = room if room is not None else Room(settings.max_active_runs, active)
        self.queue = queue
        self._waiting_work = True
        """Runs may wait for room (queued, or released while this worker was full): a place that
        frees here is a reason to look (at start: the queue may hold runs already)."""
        self._announcements = 0
        """How many times ``announced`` was called: a pass that began before the last one cannot
        tell that nothing waits any more."""
        self._wake = asyncio.Event()
        self._local_prefix = f"{local_host()}:"
        self._taking: dict[str, int] = {}
        """Runs being claimed right now (held here, not yet in ``active``), with how many claims
        of each are under way (a cancel may take over a run that the claim loop is taking)."""

    def wake(self) -> None:
        """Look for runs to take over now (a worker released one)."""
        self._wake.set()

    def announced(self) -> None:
        """A worker released a run, or a run queued: look now if there is room here; otherwise
        when a place frees (no pass of a full worker for each queued run of a burst)."""
        self._waiting_work = True
        self._announcements += 1
        if self.room.free() > 0:
            self._wake.set()

    def room_freed(self) -> None:
        """An attempt ended here: if runs may wait for room, look now."""
        if self._waiting_work:
            self._wake.set()

    # ---- this worker's leases ----------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        interval = max(self.settings.run_lease_s / 3, 0.05)
        while True:
            await asyncio.sleep(interval)
            await self.heartbeat()

    async def heartbeat(self) -> None:
        # Only runs known before the query are judged by it: a run is added to ``active`` after
        # its row is committed, so these are in the query's view, while a run started during the
        # round trip may not be.
        checked = list(self.active)
        asked_at = time.monotonic()
        try:
            await self.leases.renew_leases(checked, self.worker_id, self.settings.run_lease_s)
            ours = {run.id: run for run in await self.leases.running_of_worker(self.worker_id)}
            # The leases held at ``asked_at`` run at least a lease from then: the attempts' writes
            # need no fence until half of that has passed (store.Fence).
            self.executor.hold.confirm(asked_at)
        except Exception as exc:
            # An outage is expected now and then: its error is enough, a traceback every pass is not.
            log.warning(
                "lease renewal failed", exc_info=not database_unreachable(exc), extra={"error": repr(exc)}
            )
            return
        now = utcnow()
        for orphan in ours.values():
            expired = orphan.lease_expires_at is not None and orphan.lease_expires_at < now
            if expired and orphan.id not in self.active and orphan.id not in self._taking:
                # Held here by no attempt (a claim whose answer was lost, a close that gave up in
                # an outage), so nobody renews its lease: let it go, for any worker to carry on.
                await self._release_quietly(orphan)
        for run_id in checked:
            active = self.active.get(run_id)
            if active is None or active.finishing:
                continue
            run = ours.get(run_id)
            if run is None or run.attempt != active.attempt:
                # This worker stalled past the lease and another one took the run over: stop here.
                log.warning("run lost its lease to another worker", extra={"run_id": run_id})
                self.cancel_local(active, "lost")
            elif run.cancel_requested:
                # The cancel signal did not reach this worker (Redis was away); the row says so.
                self.cancel_local(active, "user")

    # ---- other workers' runs ----------------------------------------------------------------

    async def claim_loop(self) -> None:
        interval = min(CLAIM_INTERVAL_S, max(self.settings.run_lease_s / 3, 0.05))
        pruned_at = time.monotonic()
        while True:
            self._wake.clear()
            try:
                await self.claim_once()
                if time.monotonic() - pruned_at > PRUNE_INTERVAL_S:
                    pruned_at = time.monotonic()
                    await self.prune()
            except Exception as exc:
                log.warning(
                    "looking for runs to take over failed",
                    exc_info=not database_unreachable(exc),
                    extra={"error": repr(exc)},
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=interval)

    async def prune(self) -> int:
        """Delete old tool effects and, with CHECKPOINT_RETENTION_S set, the checkpoints of runs
        that finished that long ago (a run is replayed from them, FACES.md B-06: by default they
        are kept as long as their conversation)."""
        now = utcnow()
        keep_effects = max(EFFECTS_KEPT_S, 2 * self.settings.approval_timeout_s)
        retention = self.settings.checkpoint_retention_s
        gone = await self.runs.prune(
            now - timedelta(seconds=retention) if retention is not None else None,
            now - timedelta(seconds=keep_effects),
        )
        gone += await self.executor.approvals.repo.close_orphans()
        if gone:
            log.info("pruned what finished runs no longer need", extra={"rows": gone})
        return gone

    async def claim_once(self) -> int:
        """Take over every run that no live worker holds; returns how many this worker took."""
        if not self.accepting():
            return 0
        # Approvals nobody decided in time are denials now: their runs go on, below.
        await self.executor.approvals.expire_due()
        taken = 0
        # Workers of this host whose process is gone: their runs need not wait for their leases.
        gone = [
            worker
            for worker in await self.runs.holders(self._local_prefix)
            if worker != self.worker_id and local_process_gone(worker)
        ]
        for run in await self.runs.claimable(self.worker_id, held_by=gone):
            if not self.accepting():
                break
            if run.id in self.active:
                continue
            with self.room.reserve() as room:
                if not room and not run.cancel_requested:
                    # Full: another worker with room takes it, or this one once a place frees
                    # (a cancelled run is only closed, which takes no room).
                    self._waiting_work = True
                    continue
                try:
                    if await self.take_over(run):
                        taken += 1
                except Exception as exc:
                    # One run that cannot be taken over (an outage, a bug) must not keep the
                    # others from being taken: on to the next.
                    log.warning(
                        "could not take over a run",
                        exc_info=not database_unreachable(exc),
                        extra={"run_id": run.id, "error": repr(exc)},
                    )
        return taken + await self.start_queued()

    async def start_queued(self) -> int:
        """Start queued runs, oldest first, while this worker has room (RUNS.md Q-01); how many.
        Runs of owners at their cap wait, without holding up the others'. Each pass claims as
        many runs as there are free places in one transaction and starts them together."""
        if self.queue is None:
            return 0
        per_owner = self.settings.max_active_runs_per_owner
        started = 0
        more: bool | None = None  # whether more runs may wait than this worker had places for
        announced = self._announcements
        while self.accepting() and (free := self.room.free()) > 0:
            # Places are held only for runs that wait: a start that comes meanwhile finds this
            # worker's room as it is (with runs waiting, it would queue behind them anyway).
            waiting = await self.queue.waiting(free, per_owner=per_owner)
            more = waiting >= free
            with self.room.reserve(waiting) as places:
                if not places or not self.accepting():
                    break
                claimed = await self.queue.take_next(
                    places, self.worker_id, self.settings.run_lease_s, per_owner=per_owner
                )
                outcomes = await asyncio.gather(
                    *(self._start_claimed(run) for run in claimed), return_exceptions=True
                )
            started += len(claimed)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            if not claimed:
                break  # the runs that wait are another worker's, being taken right now
        if more is not None:
            # Runs may still wait for a place here, or (under owners' caps) for a run of their
            # owner's to end somewhere: then a place that frees here is a reason to look again.
            self._waiting_work = more or per_owner is not None or self._announcements != announced
        return started

    async def _start_claimed(self, run: RunRecord) -> None:
        """``_start`` a run this worker claimed from the queue; if that fails, let it go at once
        for the next pass of any worker (as a released run)."""
        try:
            await self._start(run)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.runs.release(run.id, run.attempt, self.worker_id)
            raise

    async def _start(self, run: RunRecord) -> None:
        """The first attempt of ``run``, taken from the queue: it starts as any run starts (its
        question and history were stored when it queued), with no ``resumed`` phase."""
        conversation = await self.conversations.get(run.owner, run.conversation_id)
        if conversation is None:
            return  # deleted meanwhile, and the run with it
        if run.model is not None and run.model not in self.executor.models:
            error = f"the run's model {run.model!r} is no longer configured (LLM_MODELS)"
            await self.close_unheld(run, RunCheckpoint(), "failed", error)
            return
        history = await self.runs.history_before(run)
        # A replay queued with the checkpoint it starts from (FACES.md B-06): it starts there.
        rows = await self.runs.checkpoints(run.id, run.attempt) if run.replay_of is not None else []
        resume = None
        if rows:
            state = RunCheckpoint.fold(_deltas(rows))
            resume = Resume(state, rows[-1].after or run.start_cursor, announce=False)
        self.metrics.runs_started.inc()
        log.info(
            "took a queued run",
            extra={"run_id": run.id, "conversation_id": run.conversation_id, "worker": self.worker_id},
        )
        self.executor.launch(
            ActiveRun(
                run.id,
                run.conversation_id,
                attempt=run.attempt,
                started=time.monotonic() - max(0.0, time.time() - run.created_at.timestamp()),
                model=run.model,
                trace_parent=run.trace_parent,
                client_tools=run.client_tools,
            ),
            conversation,
            run.message,
            history,
            await self.last_cursor(run.conversation_id),
            resume,
        )

    async def take_over(self, run: RunRecord, now: datetime | None = None) -> bool:
        """Claim ``run`` (as read) if no live worker holds it, then carry it on from its last
        checkpoint, or close it if it was cancelled or its attempts keep dying. False if it is
        held, or another worker was first."""
        self._taking[run.id] = self._taking.get(run.id, 0) + 1
        try:
            return await self._take_over(run, now)
        finally:
            left = self._taking.pop(run.id) - 1
            if left:
                self._taking[run.id] = left

    async def _release_quietly(self, run: RunRecord) -> None:
        try:
            if await self.runs.release(run.id, run.attempt, self.worker_id):
                log.warning("released a run this worker held with no attempt", extra={"run_id": run.id})
                await self.executor.released.request(run.id, run.conversation_id)
        except Exception as exc:
            log.warning("could not release a run", extra={"run_id": run.id, "error": repr(exc)})

    async def _take_over(self, run: RunRecord, now: datetime | None) -> bool:
        released = run.worker_id is None
        expired = run.lease_expires_at is not None and run.lease_expires_at < (now or utcnow())
        holder_dead = not released and not expired and local_process_gone(run.worker_id or "")
        if not (released or expired or holder_dead):
            return False
        # Read and folded before the claim, outside its transaction (on SQLite that holds the one
        # write lock). What the last attempt may still write after this read counts for nothing:
        # it no longer holds the run (it released it, died, or let its lease run out, and then
        # its writes are fenced), and a new attempt reads only its own checkpoints.
        rows = await self.runs.checkpoints(run.id, run.attempt)
        after = rows[-1].after if rows else None
        unreadable: str | None = None
        try:
            state = RunCheckpoint.fold(_deltas(rows))
            first = (
                CheckpointRow(0, after, orjson.dumps(state.encode()).decode()) if not state.empty else None
            )
        except Exception as exc:
            log.exception("could not read a run's checkpoints", extra={"run_id": run.id})
            state, first = RunCheckpoint(), None
            unreadable = f"its checkpoints could not be read ({type(exc).__name__}); the run cannot go on"

        claimed = await self.runs.claim(
            run,
            self.worker_id,
            self.settings.run_lease_s,
            lost=not released,
            holder_dead=holder_dead,
            first=first,
        )
        if claimed is None:
            return False
        log.info(
            "took over a run",
            extra={
                "run_id": run.id,
                "conversation_id": run.conversation_id,
                "attempt": claimed.attempt,
                "previous_worker": run.worker_id,
                "checkpoints": state.checkpoints,
            },
        )
        try:
            if unreadable is not None:
                await self.close_unheld(claimed, state, "failed", unreadable)
            elif claimed.cancel_requested:
                await self.close_unheld(claimed, state, "cancelled", "cancelled by the user")
            elif claimed.model is not None and claimed.model not in self.executor.models:
                # Its checkpoints were made for that model (its mode, its provider's messages):
                # another model cannot carry them on (E-02).
                error = f"the run's model {claimed.model!r} is no longer configured (LLM_MODELS)"
                await self.close_unheld(claimed, state, "failed", error)
            elif claimed.lost_attempts >= self.settings.run_max_attempts:
                error = (
                    f"the run's worker was lost {claimed.lost_attempts} times "
                    f"(RUN_MAX_ATTEMPTS={self.settings.run_max_attempts}); giving up"
                )
                await self.close_unheld(claimed, state, "failed", error)
            else:
                await self._resume(claimed, state, after or claimed.start_cursor, lost=not released)
        except BaseException as exc:
            # Not carried on, not closed (an outage, mostly): let it go at once for the next pass
            # of any worker, rather than hold it here until the lease runs out. Unless the
            # database was away, it counts as a lost attempt: a run that fails this way every
            # time ends after RUN_MAX_ATTEMPTS.
            failed = isinstance(exc, Exception) and not database_unreachable(exc)
            with contextlib.suppress(Exception):
                await self.runs.release(claimed.id, claimed.attempt, self.worker_id, lost=failed)
            raise
        return True

    async def _resume(self, run: RunRecord, state: RunCheckpoint, after: str, *, lost: bool) -> None:
        conversation = await self.conversations.get(run.owner, run.conversation_id)
        if conversation is None:
            return  # deleted meanwhile, and the run with it
        history = await self.runs.history_before(run)
        await self._salvage_events(run)
        active = ActiveRun(
            run.id,
            run.conversation_id,
            attempt=run.attempt,
            started=time.monotonic() - max(0.0, time.time() - run.created_at.timestamp()),
            usage=state.usage(),
            iterations=state.iterations(),
            model=run.model,
            trace_parent=run.trace_parent,
            client_tools=run.client_tools,
        )
        # Only a run that asked for approvals has decisions to read.
        asked = state.pending is not None and bool(state.pending.awaiting)
        decisions = await self.executor.approvals.decisions(run.id) if asked else {}
        # A run that waited for a person goes on from where it stopped: nothing is done again.
        announce = lost or not state.undecided()
        self.metrics.runs_resumed.labels("lost" if lost else "handover" if announce else "approval").inc()
        self.executor.launch(
            active,
            conversation,
            run.message,
            history,
            await self.last_cursor(run.conversation_id),
            Resume(state, after, decisions, announce),
        )

    async def last_cursor(self, conversation_id: str) -> str:
        bus_last: str | None = None
        with contextlib.suppress(Exception):
            bus_last = await self.bus.last_id(conversation_id)
        return later_cursor(bus_last, await self.events.last_id(conversation_id))

    async def close_unheld(self, run: RunRecord, state: RunCheckpoint, status: str, error: str) -> bool:
        """Close ``run``, which this worker claimed but will not carry on, with its ``done`` (in a
        short span of its own: the run's trace says how it ended)."""
        models = self.executor.models
        span = self.executor.tracing.run_span(
            run_id=run.id,
            conversation_id=run.conversation_id,
            attempt=run.attempt,
            model=run.model or models.default,
            models=models,
            traceparent=run.trace_parent,
        )
        with span:
            closed = await self._close_unheld(run, state, status, error)
            span.outcome(status if closed else "lost", error, 0, 0)
        return closed

    async def _close_unheld(self, run: RunRecord, state: RunCheckpoint, status: str, error: str) -> bool:
        await self._salvage_events(run)
        answer, iterations = progress(await self.events.for_run(run.id))
        publisher = self.executor.publisher(
            run.conversation_id, run.id, await self.last_cursor(run.conversation_id), run.attempt
        )
        queue = self.interrupt_queue(run.conversation_id, state.follow_up_position())
        # Follow-ups the run never took are named in its done and stay in the conversation (stored
        # with the close, which takes them off the queue).
        pending = await drain_quietly(queue)
        done = RunDone(
            answer=answer,
            iterations=iterations,
            usage=state.usage().as_dict(),
            elapsed=max(0.0, time.time() - run.created_at.timestamp()),
            status=status,  # type: ignore[arg-type]
            error=error,
            pending_injections=tuple(pending),
            model=run.model,
        )

        async def close(event: StoredEvent) -> bool:
            messages = follow_up_messages(pending)
            return await close_row(
                self.runs, run.id, run.attempt, run.conversation_id, done, event, messages, queue.position
            )

        try:
            finished, done_event = await close_with_done(publisher, done, close)
        except BaseException:
            with contextlib.suppress(Exception):
                await publisher.discard()
            raise
        if not finished:
            await publisher.discard()
            return False
        await publisher.publish_stored(done_event)
        with contextlib.suppress(EventPersistError):
            await publisher.close()
        self.metrics.runs.labels(status).inc()
        log.warning(
            "closed a run that no worker held",
            extra={
                "run_id": run.id,
                "conversation_id": run.conversation_id,
                "status": status,
                "error": error,
            },
        )
        return True

    async def _salvage_events(self, run: RunRecord) -> None:
        """Store the events the last attempt put on the bus but had not stored yet.

        Its clients saw them live; without this the run's durable record would miss its last
        moments (R-10). Saving is idempotent, so several workers may do it at once.
        """
        after = later_cursor(await self.events.last_id(run.conversation_id), run.start_cursor)
        try:
            while True:
                batch = await self.bus.read_after(run.conversation_id, after, limit=1000)
                if not batch:
                    return
                ours = [event for event in batch if event.run_id == run.id]
                if ours:
                    await self.events.save(run.conversation_id, ours)
                after = batch[-1].id
        except BusUnavailableError as exc:
            # Redis is away (or came back empty): what it held is gone, nothing to salvage.
            log.warning("could not read the last attempt's events from the bus", extra={"error": repr(exc)})
