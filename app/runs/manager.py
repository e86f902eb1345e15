"""RunManager: starts agent runs as background tasks and sees every one of them to a ``done`` event.

A run belongs to the worker that started it. The worker renews the run's lease while it works;
any worker's reaper closes runs whose lease expired (their worker died) as ``failed``. Cancel
crosses processes through the cancel signal; interrupts through the conversation's queue. On
shutdown the worker stops taking runs, gives its active runs a grace period, and closes the rest
as ``failed``. Whatever happens, a run's ``done`` is stored in the transaction that closes its row,
and reaches the bus after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import orjson

from app.db.errors import ConversationNotFoundError, EventIdTakenError, RunActiveError, database_unreachable
from app.db.repositories import ConversationRecord, ConversationRepo, EventRepo, RunRecord, RunRepo
from app.engine.agent import AgentConfig, AgentResult, ReActAgent
from app.engine.events import AnswerDelta, EngineEvent, IterationDone, RunDone, ThinkingStarted, Usage
from app.engine.hooks import HookRegistry
from app.engine.interrupts import InterruptQueue, InterruptQueueFullError
from app.errors import FollowUpQueueFullError, NoActiveRunError, RunActiveConflict, ShuttingDownError
from app.llm.base import LLM, ChatMessage
from app.observability import Metrics, conversation_id_var, run_id_var
from app.settings import Settings
from app.streaming.bus import EventBus, StoredEvent, later_cursor
from app.streaming.publisher import EventPersistError, RunPublisher
from app.tools.registry import ToolRegistry

log = logging.getLogger("app.runs")

T = TypeVar("T")

CLOSE_RETRY_S = 120.0
"""How long a finished run waits for an unreachable database to store its end (as the publisher)."""
CLOSE_ID_ATTEMPTS = 3
"""How many ids a run's done may try when another process stored an event under the one it took."""

CancelReason = Literal["user", "shutdown", "lost"]
"""Why a run's task was cancelled: by its user, by this worker's shutdown, or because another
worker already closed it (its lease ran out while this worker was unresponsive)."""


class CancelSignal:
    """What the manager needs of the cross-process cancel signal (memory or Redis)."""

    async def request(self, run_id: str) -> None: ...
    async def listen(self, callback: Callable[[str], Any]) -> None: ...
    async def close(self) -> None: ...


@dataclass
class _ActiveRun:
    run_id: str
    conversation_id: str
    task: asyncio.Task[None] | None = None
    cancel_reason: CancelReason | None = None
    iterations: int = 0
    started: float = field(default_factory=time.monotonic)
    usage: Usage = field(default_factory=Usage)
    """Filled by the engine as calls complete; what a cancelled run reports."""
    finishing: bool = False
    """The engine is done and the run is being closed: a cancel now would only interrupt that."""
    answer_parts: list[str] = field(default_factory=list)
    """The answer deltas sent so far: a run stopped mid-answer reports them as its answer, so the
    deltas a client saw still add up to ``done.answer``."""


def follow_up_messages(contents: list[str]) -> list[ChatMessage]:
    """Follow-ups no loop took in, kept as pinned user messages so the next run sees them."""
    return [ChatMessage(role="user", content=c, pinned=True) for c in contents]


class RunManager:
    def __init__(
        self,
        *,
        settings: Settings,
        conversations: ConversationRepo,
        runs: RunRepo,
        events: EventRepo,
        bus: EventBus,
        llm: LLM,
        tools: ToolRegistry,
        interrupts: Callable[[str], InterruptQueue],
        cancel_signal: Any,
        metrics: Metrics,
        worker_id: str,
        hooks: Callable[[], HookRegistry],
        leases: RunRepo | None = None,
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self.runs = runs
        # The heartbeat's own connections (see Database.lease_sessionmaker); the run repo otherwise.
        self.leases = leases or runs
        self.events = events
        self.bus = bus
        self.llm = llm
        self.tools = tools
        self.interrupt_queue = interrupts
        self.cancel_signal = cancel_signal
        self.metrics = metrics
        self.worker_id = worker_id
        self.hooks = hooks
        self._active: dict[str, _ActiveRun] = {}
        self._background: list[asyncio.Task[None]] = []
        self._accepting = True

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.cancel_signal.listen(self._on_cancel_requested)
        self._background.append(asyncio.create_task(self._heartbeat_loop(), name="run-heartbeat"))
        self._background.append(asyncio.create_task(self._reaper_loop(), name="run-reaper"))

    async def shutdown(self) -> None:
        """Stop taking runs; let active runs finish within the grace period; close the rest as failed."""
        self._accepting = False
        pending = [a.task for a in self._active.values() if a.task is not None]
        if pending:
            log.info("shutdown: waiting for active runs", extra={"runs": len(pending)})
            _, still = await asyncio.wait(pending, timeout=self.settings.shutdown_grace_s)
            for active in list(self._active.values()):
                if active.task is not None and active.task in still:
                    self._cancel_local(active, "shutdown")
            if still:
                await asyncio.wait(still, timeout=10)
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._background.clear()
        with contextlib.suppress(Exception):
            await self.cancel_signal.close()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def active_count(self) -> int:
        return len(self._active)

    # ---- commands --------------------------------------------------------------------------

    async def last_cursor(self, conversation_id: str) -> str:
        bus_last: str | None = None
        with contextlib.suppress(Exception):
            bus_last = await self.bus.last_id(conversation_id)
        return later_cursor(bus_last, await self.events.last_id(conversation_id))

    async def start_run(
        self, conversation: ConversationRecord, message: str, *, prior: Sequence[ChatMessage] = ()
    ) -> RunRecord:
        """Start a run on ``message`` in the background; the conversation's messages are its history.

        ``prior`` are earlier turns that came with the question (the OpenAI-compatible route sends
        a whole chat): they are stored in the conversation before it, so they are this run's history.
        """
        if not self._accepting:
            raise ShuttingDownError("this worker is shutting down; retry on another worker")
        conv_id = conversation.id
        bus_last: str | None = None
        with contextlib.suppress(Exception):
            bus_last = await self.bus.last_id(conv_id)
        try:
            # One transaction: the run, the earlier turns, the history they make, the question;
            # the start cursor is settled there too, after the previous run's stored done.
            run, history = await self.runs.start(
                conv_id,
                conversation.owner,
                message,
                worker_id=self.worker_id,
                lease_s=self.settings.run_lease_s,
                start_cursor=later_cursor(bus_last, None),
                prior=prior,
            )
        except RunActiveError as exc:
            raise RunActiveConflict("a run is already active in this conversation") from exc
        # The queue is not emptied here: what it holds was accepted (202) after the previous run
        # took its last follow-ups (in the moment before its close, or while Redis was away for
        # its drain) and was reported nowhere; this run takes it at its first step.
        active = _ActiveRun(run.id, conv_id)
        self._active[run.id] = active
        self.metrics.runs_started.inc()
        self.metrics.active_runs.inc()
        active.task = asyncio.create_task(
            self._execute(active, conversation, message, history, run.start_cursor), name=f"run-{run.id}"
        )
        return run

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

    async def cancel(self, conversation: ConversationRecord) -> RunRecord:
        run = await self.runs.active(conversation.id)
        if run is None:
            raise NoActiveRunError("no run is active in this conversation")
        local = self._active.get(run.id)
        if local is not None:
            self._cancel_local(local, "user")
        else:
            await self.cancel_signal.request(run.id)
        return run

    async def interrupt(self, conversation: ConversationRecord, content: str) -> int:
        run = await self.runs.active(conversation.id)
        if run is None:
            raise NoActiveRunError("no run is active in this conversation")
        queue = self.interrupt_queue(conversation.id)
        try:
            queued = await queue.put(content)
        except InterruptQueueFullError as exc:
            raise FollowUpQueueFullError(str(exc)) from exc
        # The run may have finished between the check and the put: then nobody will drain the
        # queue, so keep what is there in the conversation's history rather than lose it.
        latest = await self.runs.get_any(run.id)
        if latest is None or latest.status != "running":
            leftovers = await queue.drain()
            if leftovers:
                await self.conversations.add_messages(conversation.id, run.id, follow_up_messages(leftovers))
        return queued

    # ---- cancel ----------------------------------------------------------------------------

    def _on_cancel_requested(self, run_id: str) -> None:
        active = self._active.get(run_id)
        if active is not None:
            self._cancel_local(active, "user")

    @staticmethod
    def _cancel_local(active: _ActiveRun, reason: CancelReason) -> None:
        if active.finishing:
            return
        if active.cancel_reason is None:
            active.cancel_reason = reason
        if active.task is not None and not active.task.done():
            active.task.cancel()

    # ---- execution -------------------------------------------------------------------------

    def _agent_config(self, conversation: ConversationRecord) -> AgentConfig:
        spec: dict[str, Any] = conversation.agent_config or {}
        s = self.settings
        mode = spec.get("mode", "auto")
        return AgentConfig(
            max_iterations=int(spec.get("max_iterations") or s.react_max_iterations),
            use_native_tools=mode != "json",
            completion_check=bool(spec.get("completion_check", True)),
            completion_check_min_tools=s.react_completion_check_min_tools,
            cycle_detection_threshold=s.react_cycle_detection_threshold,
            self_reflection_interval=s.react_self_reflection_interval,
            tool_selection_threshold=s.tool_selection_threshold,
            context_token_budget=s.context_token_budget,
            system_prompt=spec.get("system_prompt") or None,
        )

    def _tools_for(self, conversation: ConversationRecord) -> ToolRegistry:
        names = (conversation.agent_config or {}).get("tools")
        # No list means every tool; an empty list means none (an agent that only talks).
        return self.tools if names is None else self.tools.subset(names)

    async def _execute(
        self,
        active: _ActiveRun,
        conversation: ConversationRecord,
        message: str,
        history: list[ChatMessage],
        start_cursor: str,
    ) -> None:
        run_id_var.set(active.run_id)
        conversation_id_var.set(active.conversation_id)
        publisher = RunPublisher(
            self.bus,
            self.events,
            active.conversation_id,
            active.run_id,
            last_id=start_cursor,
            retention_s=self.settings.stream_retention_s,
            on_published=self._count_published,
            permanent_store_errors=(ConversationNotFoundError,),
        )
        engine_done: list[RunDone] = []

        async def sink(event: EngineEvent) -> None:
            if isinstance(event, RunDone):
                engine_done.append(event)
                return
            if type(event) is AnswerDelta:
                active.answer_parts.append(event.content)
            elif isinstance(event, ThinkingStarted):
                active.iterations = max(active.iterations, event.iteration)
            elif isinstance(event, IterationDone):
                self.metrics.tool_calls.labels(event.tool_name, "error" if event.error else "ok").inc()
            await publisher.publish(event)

        queue = self.interrupt_queue(active.conversation_id)
        agent = ReActAgent(
            self.llm, self._tools_for(conversation), self._agent_config(conversation), self.hooks()
        )
        log.info("run started", extra={"worker": self.worker_id})
        result: AgentResult | None = None
        status: str
        error: str | None = None
        try:
            result = await agent.run(
                message,
                sink=sink,
                history=history,
                interrupts=queue,
                run_id=active.run_id,
                conversation_id=active.conversation_id,
                usage=active.usage,
            )
            status = result.status
            error = result.error
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if active.cancel_reason == "user":
                status, error = "cancelled", "cancelled by the user"
            elif active.cancel_reason == "lost":
                status, error = "failed", "another worker closed the run (its lease expired)"
            else:
                status, error = "failed", "the worker shut down before the run finished"
        except Exception as exc:
            log.exception("run crashed")
            status, error = "failed", f"internal error: {type(exc).__name__}"
        active.finishing = True
        try:
            if active.cancel_reason == "lost":
                # Closed with its done by another worker: add nothing after that done (what this
                # worker still had queued is dropped), and leave the conversation's queue to
                # whichever run comes next.
                log.warning("run was closed by another worker; stopped it here")
                await publisher.discard()
            else:
                await self._finish(active, publisher, queue, result, engine_done, status, error)
        except ConversationNotFoundError:
            log.info("the conversation was deleted while its run worked; nothing to store")
        except Exception:
            log.exception("could not close the run cleanly")
        finally:
            # Whatever stopped _finish, the publisher's tasks must not outlive the run.
            with contextlib.suppress(Exception):
                await publisher.close()
            self._active.pop(active.run_id, None)
            self.metrics.active_runs.dec()

    async def _finish(
        self,
        active: _ActiveRun,
        publisher: RunPublisher,
        queue: InterruptQueue,
        result: AgentResult | None,
        engine_done: list[RunDone],
        status: str,
        error: str | None,
    ) -> None:
        conv_id = active.conversation_id
        # The done is stored in the transaction that closes the run: the next run of the
        # conversation cannot start before that commit, and starts after this done (RunRepo.start).
        # Everything published before it is stored first (the bus may lag behind, in an outage),
        # so that the log never has a done ahead of the events it ends.
        with contextlib.suppress(EventPersistError):  # the publisher logged it; close all the same
            await publisher.flush_store()
        # Drained only now: a follow-up accepted until here (the run still looked active) is
        # either taken here or, for the moment until the close commits, as before: at most one
        # transaction's window.
        pending = list(result.pending_injections) if result is not None else []
        pending += await _drain_quietly(queue)
        new_messages: list[ChatMessage] = []
        if result is not None:
            new_messages = list(result.messages)
            if new_messages and new_messages[0].role == "user":
                new_messages = new_messages[1:]  # the question was stored when the run started
        # Untaken follow-ups stay in the conversation for the next run.
        new_messages += follow_up_messages(pending)
        if result is not None and engine_done:
            done = replace(engine_done[-1], pending_injections=tuple(pending))
        else:
            done = RunDone(
                answer=result.answer if result is not None else "".join(active.answer_parts),
                iterations=result.iterations if result is not None else active.iterations,
                usage=result.usage.as_dict() if result is not None else active.usage.as_dict(),
                elapsed=time.monotonic() - active.started,
                status=status,  # type: ignore[arg-type]
                error=error,
                pending_injections=tuple(pending),
            )

        async def close(stamped: StoredEvent) -> bool:
            return await _while_unreachable(
                lambda: self._close_row(active.run_id, conv_id, done, stamped, new_messages)
            )

        finished, done_event = await _close_with_done(publisher, done, close)
        if not finished:
            log.warning("run was already closed elsewhere; its done event is not sent twice")
            await publisher.discard()  # nothing of it may follow the other close's done
            return
        await publisher.publish_stored(done_event)
        self.metrics.runs.labels(done.status).inc()
        log.info("run finished", extra={"status": done.status, "iterations": done.iterations})
        with contextlib.suppress(EventPersistError):  # events missing from the log: logged already
            await publisher.close()

    async def _close_row(
        self,
        run_id: str,
        conversation_id: str,
        done: RunDone,
        stamped: StoredEvent,
        messages: Sequence[ChatMessage],
    ) -> bool:
        """Close the run's row as ``done`` says, with ``messages`` and the stamped done itself."""
        return await self.runs.finish(
            run_id,
            status=done.status,
            answer=done.answer,
            iterations=done.iterations,
            usage=dict(done.usage),
            elapsed=done.elapsed,
            error=done.error,
            pending_injections=list(done.pending_injections),
            messages=messages,
            conversation_id=conversation_id,
            done=stamped,
        )

    def _count_published(self, events: list[StoredEvent]) -> None:
        self.metrics.events_published.inc(len(events))

    # ---- leases ----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = max(self.settings.run_lease_s / 3, 0.05)
        while True:
            await asyncio.sleep(interval)
            if not self._active:
                continue
            # Only runs known before the query are judged by it: a run is added to _active after
            # its row is committed, so these are in the query's view, while a run started during
            # the round trip may not be.
            checked = list(self._active)
            try:
                await self.leases.renew_leases(checked, self.worker_id, self.settings.run_lease_s)
                still_ours = {run.id for run in await self.leases.running_of_worker(self.worker_id)}
            except Exception as exc:
                # An outage is expected now and then: its error is enough, a traceback every pass is not.
                log.warning(
                    "lease renewal failed", exc_info=not database_unreachable(exc), extra={"error": repr(exc)}
                )
                continue
            for run_id in checked:
                active = self._active.get(run_id)
                if active is not None and run_id not in still_ours and not active.finishing:
                    # This worker stalled past the lease and another one closed the run: stop it.
                    log.warning("run lost its lease to another worker", extra={"run_id": run_id})
                    self._cancel_local(active, "lost")

    async def _reaper_loop(self) -> None:
        interval = max(self.settings.run_lease_s / 2, 0.05)
        while True:
            try:
                await self.reap_once()
            except Exception as exc:
                log.warning(
                    "reaper pass failed", exc_info=not database_unreachable(exc), extra={"error": repr(exc)}
                )
            await asyncio.sleep(interval)

    async def reap_once(self) -> int:
        """Close runs whose worker stopped renewing their lease; returns how many were closed."""
        closed = 0
        for run in await self.runs.expired():
            if run.id in self._active:
                continue
            if await self.close_lost_run(run, "the worker running it stopped responding (lease expired)"):
                closed += 1
        return closed

    async def close_lost_run(self, run: RunRecord, error: str) -> bool:
        elapsed = max(0.0, time.time() - run.created_at.timestamp())
        await self._salvage_events(run)
        answer, iterations = _progress(await self.events.for_run(run.id))
        # Follow-ups the lost run never took are named in its done and stay in the conversation
        # (stored with the close). Taken only while the run is still open, so that the queue of
        # a run started after a close elsewhere is left alone, and put back if the close fails.
        current = await self.runs.get_any(run.id)
        if current is None or current.status != "running":
            return False
        publisher = RunPublisher(
            self.bus,
            self.events,
            run.conversation_id,
            run.id,
            last_id=await self.last_cursor(run.conversation_id),
            retention_s=self.settings.stream_retention_s,
            on_published=self._count_published,
            permanent_store_errors=(ConversationNotFoundError,),
        )
        queue = self.interrupt_queue(run.conversation_id)
        pending = await _drain_quietly(queue)
        done = RunDone(
            answer=answer,
            iterations=iterations,
            usage=Usage().as_dict(),
            elapsed=elapsed,
            status="failed",
            error=error,
            pending_injections=tuple(pending),
        )
        stamped: list[StoredEvent] = []

        async def close(event: StoredEvent) -> bool:
            stamped.append(event)
            return await self._close_row(
                run.id, run.conversation_id, done, event, follow_up_messages(pending)
            )

        try:
            finished, done_event = await _close_with_done(publisher, done, close)
        except BaseException:
            # The follow-ups go back unless this close went through after all (its answer lost).
            if not (stamped and await self._holds_quietly(run.conversation_id, stamped[-1])):
                await _put_back(queue, pending)
            raise
        if not finished:
            return False
        await publisher.publish_stored(done_event)
        with contextlib.suppress(EventPersistError):
            await publisher.close()
        self.metrics.runs.labels("failed").inc()
        log.warning(
            "closed a run whose worker was lost",
            extra={"run_id": run.id, "conversation_id": run.conversation_id},
        )
        return True

    async def _holds_quietly(self, conversation_id: str, event: StoredEvent) -> bool:
        """Whether ``event`` is stored; False when the database cannot tell."""
        try:
            return await self.events.holds(conversation_id, event)
        except Exception:
            return False

    async def _salvage_events(self, run: RunRecord) -> None:
        """Store the events the lost worker put on the bus but had not stored yet.

        Its clients saw them live; without this the run's durable record would miss its last
        moments. Saving is idempotent, so several reapers may do it at once.
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
        except Exception:
            log.warning("could not salvage the lost run's events from the bus", exc_info=True)


async def _while_unreachable(write: Callable[[], Awaitable[T]]) -> T:
    """``write()``, tried again while the database is unreachable, for up to ``CLOSE_RETRY_S``.

    A run that ends during a database outage is then still closed, with its done, once the
    database is back, instead of being left to the reaper as lost.
    """
    deadline = time.monotonic() + CLOSE_RETRY_S
    attempt = 0
    while True:
        try:
            return await write()
        except Exception as exc:
            if not database_unreachable(exc) or time.monotonic() > deadline:
                raise
            log.warning("database unreachable while closing the run; retrying", extra={"error": repr(exc)})
            attempt += 1
            await asyncio.sleep(min(2.0, 0.05 * 2.0**attempt))


async def _drain_quietly(queue: InterruptQueue) -> list[str]:
    """The queue's follow-ups, or none while its store (Redis) is unreachable: a run must still
    start, and end with its done, during an outage."""
    try:
        return await queue.drain()
    except Exception as exc:
        log.warning("could not drain the interrupt queue", extra={"error": repr(exc)})
        return []


async def _close_with_done(
    publisher: RunPublisher, done: RunDone, close: Callable[[StoredEvent], Awaitable[bool]]
) -> tuple[bool, StoredEvent]:
    """``close(done as stamped)``, stamped again under the next id if another process took that one
    (the close kept nothing then): whether the run was closed, and the done as stored."""
    for _ in range(CLOSE_ID_ATTEMPTS - 1):
        stamped = publisher.stamp(done)
        try:
            return await close(stamped), stamped
        except EventIdTakenError as exc:
            log.warning("the done's event id was taken; stamping it again", extra={"error": str(exc)})
    stamped = publisher.stamp(done)
    return await close(stamped), stamped


async def _put_back(queue: InterruptQueue, contents: list[str]) -> None:
    """Return drained follow-ups to their queue (after them if others arrived meanwhile)."""
    for content in contents:
        try:
            await queue.put(content)
        except Exception as exc:
            log.warning("a follow-up could not be put back in its queue", extra={"error": repr(exc)})


def _progress(events: list[StoredEvent]) -> tuple[str, int]:
    """A lost run's answer so far (its deltas) and the last iteration it reached, from its events."""
    parts: list[str] = []
    iterations = 0
    for event in events:
        if event.event == "answer" or event.event == "step":
            data = orjson.loads(event.data)
            if event.event == "answer" and data.get("status") == "delta":
                parts.append(str(data.get("content", "")))
            elif isinstance(data.get("iteration"), int):
                iterations = max(iterations, data["iteration"])
    return "".join(parts), iterations
