"""RunManager: starts agent runs as background tasks and sees every one of them to a ``done`` event.

A run's state lives in the database (RUNS.md R-01): the worker that executes an attempt of it
renews its lease and checkpoints its progress; when that worker dies, or stops and hands the run
over, any worker claims it and carries it on from its last checkpoint (``app.runs.takeover``).
Cancel crosses processes through the cancel signal and the run's row; interrupts through the
conversation's queue. On shutdown the worker stops taking runs, gives its active runs a grace
period, and releases the rest for another worker at once. Whatever happens, a run's ``done`` is
stored in the transaction that closes its row, and reaches the bus after that.

``execution`` runs one attempt; ``takeover`` holds the heartbeat and the claim loop; ``closing``
the steps every close shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from app.db.errors import QueueFullError, RunActiveError
from app.db.models import ACTIVE_STATUSES
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.approvals import ApprovalRepo
from app.db.repositories.follow_ups import FollowUpRepo
from app.db.repositories.push_configs import NewPushConfig
from app.db.repositories.queue import Admission, RunQueue
from app.db.repositories.run_start import UNDER_HEAD, Opening, Placement
from app.engine.events import RunQueued
from app.engine.hooks import HookRegistry
from app.engine.interrupts import InterruptQueueFullError
from app.errors import (
    FollowUpQueueFullError,
    NoActiveRunError,
    QueueFullConflict,
    RunActiveConflict,
    ShuttingDownError,
)
from app.llm.base import ChatMessage
from app.llm.models import ModelRegistry
from app.observability import Metrics
from app.runs.approvals import ApprovalDesk
from app.runs.capacity import Room
from app.runs.execution import ActiveRun, CancelReason, Executor, InterruptQueues, Resume
from app.runs.replay import ReplayStart
from app.runs.takeover import Takeover
from app.settings import Settings
from app.streaming.bus import EventBus, StoredEvent, later_cursor
from app.streaming.redis_signals import MemoryCancelSignal
from app.streaming.stamp import stamp_after
from app.tools.registry import ToolRegistry
from app.tracing import NO_TRACING, Tracing

log = logging.getLogger("app.runs")

HANDOVER_WAIT_S = 10.0
"""How long shutdown waits for the runs it stopped to store their state and let go."""


class RunManager:
    def __init__(
        self,
        *,
        settings: Settings,
        conversations: ConversationRepo,
        runs: RunRepo,
        events: EventRepo,
        bus: EventBus,
        models: ModelRegistry,
        tools: ToolRegistry,
        interrupts: InterruptQueues,
        follow_ups: FollowUpRepo,
        cancel_signal: Any,
        metrics: Metrics,
        worker_id: str,
        hooks: Callable[[], HookRegistry],
        approvals: ApprovalRepo,
        leases: RunRepo | None = None,
        queue: RunQueue | None = None,
        released_signal: Any = None,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self.runs = runs
        self.events = events
        self.bus = bus
        self.interrupt_queue = interrupts
        self.follow_ups = follow_ups
        self.cancel_signal = cancel_signal
        # Announces runs a stopping worker released, so that another takes them at once,
        # and runs that queued, so that a worker with room takes them at once.
        self.released_signal = released_signal if released_signal is not None else MemoryCancelSignal()
        self.metrics = metrics
        self.worker_id = worker_id
        self._active: dict[str, ActiveRun] = {}
        self.room = Room(settings.max_active_runs, self._active)
        self.queue = queue
        self._background: list[asyncio.Task[None]] = []
        self._claims: asyncio.Task[None] | None = None
        self._accepting = True
        self.executor = Executor(
            settings=settings,
            runs=runs,
            events=events,
            bus=bus,
            models=models,
            tools=tools,
            interrupts=interrupts,
            hooks=hooks,
            metrics=metrics,
            worker_id=worker_id,
            released=self.released_signal,
            active=self._active,
            cancel_local=self._cancel_local,
            approvals=ApprovalDesk(approvals, metrics),
            tracing=tracing,
            on_room=lambda: self.takeover.room_freed(),
        )
        self.takeover = Takeover(
            settings=settings,
            conversations=conversations,
            runs=runs,
            # The heartbeat's own connections (see Database.lease_sessionmaker); the run repo otherwise.
            leases=leases or runs,
            events=events,
            bus=bus,
            executor=self.executor,
            interrupts=interrupts,
            metrics=metrics,
            worker_id=worker_id,
            active=self._active,
            accepting=lambda: self._accepting,
            cancel_local=self._cancel_local,
            room=self.room,
            queue=queue,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # After a reconnect, requests sent meanwhile are found by their keys.
        await self.cancel_signal.listen(
            self._on_cancel_requested,
            lambda: [(active.run_id, active.conversation_id) for active in self._active.values()],
        )
        await self.released_signal.listen(lambda _run_id: self.takeover.announced())
        self._claims = asyncio.create_task(self.takeover.claim_loop(), name="run-claims")
        self._background.append(asyncio.create_task(self.takeover.heartbeat_loop(), name="run-heartbeat"))
        self._background.append(self._claims)

    async def shutdown(self) -> None:
        """Stop taking runs; let active runs finish within the grace period; hand the rest over."""
        self._accepting = False
        if self._claims is not None:
            # No run taken over from now on (one being taken over now is in ``_active`` after
            # this); the heartbeat goes on renewing the leases through the grace period.
            self._claims.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._claims
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while True:
            # Looked at again after each wait: a run whose start was under way joins them late.
            pending = [a.task for a in self._active.values() if a.task is not None and not a.task.done()]
            if not pending:
                break
            left = deadline - time.monotonic()
            if left > 0:
                log.info("shutdown: waiting for active runs", extra={"runs": len(pending)})
                await asyncio.wait(pending, timeout=left)
                continue
            for active in list(self._active.values()):
                if active.task is not None and not active.task.done():
                    self._cancel_local(active, "handover")
            await asyncio.wait(pending, timeout=HANDOVER_WAIT_S)
            break
        await self._release_unattended()
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._background.clear()
        for signal in (self.cancel_signal, self.released_signal):
            with contextlib.suppress(Exception):
                await signal.close()

    async def _release_unattended(self) -> None:
        """Runs this worker holds with no attempt at work here (a claim cut short by the shutdown)
        go to another worker now, not when their leases run out."""
        try:
            for run in await self.runs.running_of_worker(self.worker_id):
                if run.id not in self._active and await self.runs.release(
                    run.id, run.attempt, self.worker_id
                ):
                    log.info("shutdown: released a run held with no attempt", extra={"run_id": run.id})
                    with contextlib.suppress(Exception):
                        await self.released_signal.request(run.id, run.conversation_id)
        except Exception as exc:
            log.warning("shutdown: could not release the runs held here", extra={"error": repr(exc)})

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def active_count(self) -> int:
        return len(self._active)

    # ---- commands --------------------------------------------------------------------------

    async def last_cursor(self, conversation_id: str) -> str:
        return await self.takeover.last_cursor(conversation_id)

    async def start_run(
        self,
        conversation: ConversationRecord,
        message: str,
        *,
        prior: Sequence[ChatMessage] = (),
        placement: Placement = UNDER_HEAD,
        client_tools: list[dict[str, Any]] | None = None,
        replay: ReplayStart | None = None,
        webhook: str | None = None,
        push_configs: Sequence[NewPushConfig] = (),
    ) -> RunRecord:
        """Start a run on ``message`` in the background; the conversation's messages are its history.
        If this worker is full, its owner at its cap, or runs queue already, the run queues instead
        (status ``queued``) for whichever worker has room first (RUNS.md Q-01).

        ``prior`` are earlier turns that came with the question (the OpenAI-compatible route sends
        a whole chat): they are stored in the conversation before it, so they are this run's history.
        ``placement``: where the question goes in the conversation's tree (FACES.md B-02, B-03);
        ``client_tools``: tools the client runs, for this run alone (C-01); ``replay``: the run
        starts from another run's checkpoint (B-06). ``webhook``: a URL (checked by the caller)
        that gets the run's record when it waits and when it ends (N-07); ``push_configs``: the A2A
        push notification configs of the new task (N-06), stored with the run.
        """
        if not self._accepting:
            raise ShuttingDownError("this worker is shutting down; retry on another worker")
        conv_id = conversation.id

        async def bus_last_id() -> str | None:
            with contextlib.suppress(Exception):
                return await self.bus.last_id(conv_id)
            return None

        # Both at once. The hint is read before the start, which takes what waits then: a later
        # follow-up moves it.
        bus_last, seen = await asyncio.gather(bus_last_id(), self.interrupt_queue(conv_id).version())
        queued: list[StoredEvent] = []
        opened: list[Opening] = []

        def queued_event(run_id: str, after: str, position: int) -> StoredEvent:
            queued[:] = [stamp_after(RunQueued(position), run_id, after)]
            return queued[0]

        def opening(run_id: str, after: str) -> Opening:
            assert replay is not None
            opened[:] = [replay.opening(run_id, after)]
            return opened[0]

        model = (conversation.agent_config or {}).get("model")
        if replay is not None and replay.model:
            model = replay.model

        settings = self.settings
        with self.room.reserve() as room:
            try:
                # One transaction: the run, the earlier turns, the history they make, the question;
                # the start cursor is settled there too, after the previous run's stored done. And
                # whether it runs here and now or queues, with its queued phase.
                run, history = await self.runs.start(
                    conv_id,
                    conversation.owner,
                    message,
                    worker_id=self.worker_id,
                    lease_s=settings.run_lease_s,
                    start_cursor=later_cursor(bus_last, None),
                    prior=prior,
                    model=self.executor.models.resolve(model),
                    # The request's span: each attempt's span is its child, on whichever worker.
                    trace_parent=self.executor.tracing.traceparent(),
                    admission=Admission(
                        room > 0, settings.max_active_runs_per_owner, settings.max_queued_runs
                    )
                    if self.queue is not None
                    else None,
                    queued_event=queued_event,
                    placement=placement,
                    client_tools=client_tools,
                    opening=opening if replay is not None else None,
                    replay_of=replay.source_run_id if replay is not None else None,
                    webhook=webhook,
                    push_configs=push_configs,
                )
            except RunActiveError as exc:
                raise RunActiveConflict("a run is already active in this conversation") from exc
            except QueueFullError as exc:
                self.metrics.runs_refused.inc()
                raise QueueFullConflict(str(exc)) from exc
            if opened and opened[0].events:
                await self._announce(run, opened[0].events, "the replayed steps")
            if run.status == "queued":
                await self._announce_queued(run, queued[0])
                return run
            # What the queue held (accepted after the previous run took its last follow-ups, in the
            # moment before its close) is in this run's history now (RunRepo.start).
            self.metrics.runs_started.inc()
            last_id = run.start_cursor
            resume: Resume | None = None
            if replay is not None:
                last_id = opened[0].events[-1].id if opened[0].events else run.start_cursor
                resume = Resume(replay.state, last_id, announce=False)
            self.executor.launch(
                ActiveRun(
                    run.id,
                    conv_id,
                    model=run.model,
                    trace_parent=run.trace_parent,
                    client_tools=client_tools,
                ),
                conversation,
                message,
                history,
                last_id,
                resume,
                seen=seen,
            )
        return run

    async def _announce(self, run: RunRecord, events: list[StoredEvent], what: str) -> None:
        """Events stored with a run's start, to its followers (a follower that misses them reads
        them from the database: the next event names them)."""
        try:
            await self.bus.append(run.conversation_id, events)
        except Exception as exc:
            log.warning(f"could not publish {what}", extra={"error": repr(exc)})

    async def _announce_queued(self, run: RunRecord, event: StoredEvent) -> None:
        """A run that queued: its ``queued`` phase (stored with it) to its followers, and word to
        every worker, so that one with room takes it at once (Q-01)."""
        self.metrics.runs_queued.inc()
        log.info("run queued", extra={"run_id": run.id, "conversation_id": run.conversation_id})
        await self._announce(run, [event], "the queued phase")
        try:
            await self.released_signal.request(run.id, run.conversation_id)
        except Exception as exc:  # the claim loops find it on their next pass
            log.warning("could not announce the queued run", extra={"error": repr(exc)})

    async def start_in_new_conversation(
        self,
        owner: str,
        title: str,
        agent_config: dict[str, Any],
        message: str,
        *,
        prior: Sequence[ChatMessage] = (),
    ) -> tuple[ConversationRecord, RunRecord]:
        """A new conversation with a run started in it, or, if the run cannot start (this worker
        is shutting down, an outage), nothing: the conversation is removed again."""
        if not self._accepting:
            raise ShuttingDownError("this worker is shutting down; retry on another worker")
        conversation = await self.conversations.create(owner, title, agent_config)
        try:
            run = await self.start_run(conversation, message, prior=prior)
        except BaseException:
            try:
                await self.conversations.delete(owner, conversation.id)
            except Exception as exc:
                log.warning(
                    "could not remove the conversation of a run that did not start",
                    extra={"conversation_id": conversation.id, "error": repr(exc)},
                )
            raise
        return conversation, run

    async def cancel(self, conversation: ConversationRecord, *, run_id: str | None = None) -> RunRecord:
        """Cancel the conversation's active run, wherever it is: executing here or on another
        worker, or held by none (between attempts), in which case it is closed here and now.
        ``run_id``: only if that is the active run (``NoActiveRunError`` otherwise)."""
        run = await self.runs.active(conversation.id)
        if run is None or run_id not in (None, run.id):
            raise NoActiveRunError("no run is active in this conversation")
        # The row keeps the request first, for whichever worker holds the run next: this
        # one may die before the run's close, or hold an attempt that lost the run.
        await self.runs.request_cancel(run.id)
        local = self._active.get(run.id)
        if local is not None and local.attempt == run.attempt:
            self._cancel_local(local, "user")
            return run
        try:
            await self.cancel_signal.request(run.id, run.conversation_id)
        except Exception as exc:
            # The cancel is on the run's row: its holder's heartbeat sees it there.
            log.warning("could not signal the cancel", extra={"error": repr(exc)})
        latest = await self.runs.get_any(run.id)
        if latest is not None and latest.status == "running" and latest.id not in self._active:
            try:
                await self.takeover.take_over(latest)
            except Exception as exc:
                # The cancel is on the run's row: the next worker to take it over closes it.
                log.warning("could not close the cancelled run now", extra={"error": repr(exc)})
        return run

    async def interrupt(
        self, conversation: ConversationRecord, content: str, *, run_id: str | None = None
    ) -> int:
        """A follow-up for the conversation's active run (``run_id``: only if that is the active
        run; ``NoActiveRunError`` otherwise)."""
        run = await self.runs.active(conversation.id)
        if run is None or run_id not in (None, run.id):
            raise NoActiveRunError("no run is active in this conversation")
        queue = self.interrupt_queue(conversation.id)
        try:
            queued = await queue.put(content)
        except InterruptQueueFullError as exc:
            raise FollowUpQueueFullError(str(exc)) from exc
        # The run may have closed between the check and the put: then nobody takes the queue, so
        # what is there is kept in the conversation's history instead (unless a new run has it).
        latest = await self.runs.get_any(run.id)
        if latest is None or latest.status not in ACTIVE_STATUSES:
            await self.follow_ups.keep_if_no_run(conversation.id, run.id)
        return queued

    # ---- cancel ----------------------------------------------------------------------------

    def _on_cancel_requested(self, run_id: str) -> None:
        active = self._active.get(run_id)
        if active is not None:
            self._cancel_local(active, "user")

    @staticmethod
    def _cancel_local(active: ActiveRun, reason: CancelReason) -> None:
        if active.finishing:
            return
        if active.cancel_reason is None:
            active.cancel_reason = reason
        if active.task is not None and not active.task.done():
            active.task.cancel()
