"""One attempt of a run: the agent at work in a background task, its events and checkpoints
published, and its end (closed with its ``done``, handed over, or dropped when it lost the run).

A run's first attempt starts with the run; a new attempt starts where the run's last checkpoint
left it (RUNS.md R-03), announced by a ``resumed`` phase. Whatever stops an attempt, it ends in one
of three ways: the run is closed with its ``done`` (completed, failed, cancelled), it is released
for another worker to carry on (this worker is shutting down, R-08), or, if another attempt holds
the run now, nothing more of this one is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from app.db.errors import ConversationNotFoundError
from app.db.repositories import ConversationRecord, EventRepo, RunRepo
from app.db.repositories.rows import follow_up_messages
from app.engine.agent import AgentConfig, AgentResult, ReActAgent
from app.engine.approvals import ApprovalDecision
from app.engine.events import (
    AnswerDelta,
    ApprovalRequested,
    EngineEvent,
    FellBack,
    IterationDone,
    IterationStarted,
    RunDone,
    RunResumed,
    ThinkingStarted,
    Usage,
)
from app.engine.hooks import HookRegistry
from app.engine.state import RunCheckpoint
from app.llm.base import ChatMessage
from app.llm.models import ModelRegistry
from app.observability import Metrics, conversation_id_var, run_id_var
from app.runs.approvals import ApprovalDesk, RunApprovals, approval_policy, client_tools_of
from app.runs.checkpointer import RunCheckpointer
from app.runs.closing import (
    close_row,
    close_with_done,
    drain_quietly,
    while_unreachable,
)
from app.runs.follow_ups import DurableInterruptQueue
from app.settings import Settings
from app.streaming.bus import EventBus, StoredEvent
from app.streaming.publisher import RunPublisher
from app.streaming.store import EventPersistError, Fence, HoldClock
from app.tools.registry import ToolRegistry
from app.tracing import NO_TRACING, Tracing
from app.tracing.genai import NoRunSpan, RunSpan

log = logging.getLogger("app.runs")

CancelReason = Literal["user", "handover", "lost"]
"""Why an attempt's task was cancelled: by its user; by this worker's shutdown, which hands the
run over; or because another attempt holds the run now (this worker stalled past its lease)."""


class InterruptQueues(Protocol):
    """A conversation's follow-up queue, as a run takes it from a position (None: from its start),
    ``seen`` the hint before it started."""

    def __call__(
        self, conversation_id: str, position: int | None = None, *, seen: object | None = None
    ) -> DurableInterruptQueue: ...


RELEASE_RETRY_S = 5.0
"""How long a worker that stops tries to release a run; after that the lease runs out instead."""


@dataclass
class ActiveRun:
    """An attempt of a run that this worker executes."""

    run_id: str
    conversation_id: str
    attempt: int = 1
    task: asyncio.Task[None] | None = None
    cancel_reason: CancelReason | None = None
    iterations: int = 0
    started: float = field(default_factory=time.monotonic)
    """When the run started, on this process's monotonic clock (earlier attempts included)."""
    usage: Usage = field(default_factory=Usage)
    """Filled by the engine as calls complete (from the checkpoint on, for a resumed run); what a
    cancelled run reports."""
    finishing: bool = False
    """The engine is done and the run is being closed: a cancel now would only interrupt that."""
    answer_parts: list[str] = field(default_factory=list)
    """The answer deltas this attempt sent: a run stopped mid-answer reports them as its answer, so
    the deltas a client saw after the last ``resumed`` still add up to ``done.answer``."""
    model: str | None = None
    """The configured model the run is bound to (its row's ``model``; None: the default)."""
    trace_parent: str | None = None
    """The request that started the run (W3C traceparent): the parent of the attempt's span."""
    client_tools: list[dict[str, Any]] | None = None
    """Tools the client runs declared for this run alone (its row's; FACES.md C-01)."""


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a new attempt starts: the run's folded checkpoints and the last event they cover,
    with the decisions on its approvals. ``announce``: a ``resumed`` phase starts the attempt (not
    when the run only goes on after a person's decision: nothing of it is done again)."""

    state: RunCheckpoint
    after: str
    decisions: Mapping[str, ApprovalDecision] = field(default_factory=dict)
    announce: bool = True


def agent_config(settings: Settings, conversation: ConversationRecord) -> AgentConfig:
    spec: dict[str, Any] = conversation.agent_config or {}
    s = settings
    return AgentConfig(
        max_iterations=int(spec.get("max_iterations") or s.react_max_iterations),
        use_native_tools=spec.get("mode", "auto") != "json",
        completion_check=bool(spec.get("completion_check", True)),
        completion_check_min_tools=s.react_completion_check_min_tools,
        cycle_detection_threshold=s.react_cycle_detection_threshold,
        self_reflection_interval=s.react_self_reflection_interval,
        tool_selection_threshold=s.tool_selection_threshold,
        context_token_budget=s.context_token_budget,
        system_prompt=spec.get("system_prompt") or None,
    )


class Executor:
    """Runs attempts of runs for one worker; ``active`` (shared with the run manager) holds them."""

    def __init__(
        self,
        *,
        settings: Settings,
        runs: RunRepo,
        events: EventRepo,
        bus: EventBus,
        models: ModelRegistry,
        tools: ToolRegistry,
        interrupts: InterruptQueues,
        hooks: Callable[[], HookRegistry],
        metrics: Metrics,
        worker_id: str,
        released: Any,
        active: dict[str, ActiveRun],
        cancel_local: Callable[[ActiveRun, CancelReason], None],
        approvals: ApprovalDesk,
        tracing: Tracing = NO_TRACING,
        on_room: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.on_room = on_room
        """Told when an attempt ends here: a place is free for a queued run (RUNS.md Q-01)."""
        self.tracing = tracing
        self.approvals = approvals
        self.hold = HoldClock()
        """When the heartbeat last confirmed this worker's leases (the fences of its attempts)."""
        self.runs = runs
        self.events = events
        self.bus = bus
        self.models = models
        self.tools = tools
        self.interrupt_queue = interrupts
        self.hooks = hooks
        self.metrics = metrics
        self.worker_id = worker_id
        self.released = released
        self.active = active
        self.cancel_local = cancel_local

    def publisher(
        self,
        conversation_id: str,
        run_id: str,
        last_id: str | None,
        attempt: int,
        on_lost: Callable[[], object] | None = None,
    ) -> RunPublisher:
        """The publisher of ``attempt`` of a run: what it stores counts only while that attempt
        holds the run (``on_lost`` is told when it no longer does)."""
        return RunPublisher(
            self.bus,
            self.events,
            conversation_id,
            run_id,
            last_id=last_id,
            retention_s=self.settings.stream_retention_s,
            linger_ms=self.settings.stream_linger_ms,
            on_published=self._count_published,
            permanent_store_errors=(ConversationNotFoundError,),
            store_before_bus=self.settings.redis_url is None,
            fence=Fence(run_id, attempt, self.worker_id, self.settings.run_lease_s, hold=self.hold),
            on_lost=on_lost,
        )

    def _count_published(self, events: list[StoredEvent]) -> None:
        self.metrics.events_published.inc(len(events))

    def launch(
        self,
        active: ActiveRun,
        conversation: ConversationRecord,
        question: str,
        history: list[ChatMessage],
        last_id: str | None,
        resume: Resume | None = None,
        seen: object | None = None,
    ) -> None:
        """Execute ``active`` in a background task of its own; ``seen``: the follow-up hint before
        the run started."""
        self.active[active.run_id] = active
        self.metrics.active_runs.inc()
        self.metrics.attempts.inc()
        active.task = asyncio.create_task(
            self._execute(active, conversation, question, history, last_id, resume, seen),
            name=f"run-{active.run_id}",
        )

    def _tools_for(self, conversation: ConversationRecord, active: ActiveRun) -> ToolRegistry:
        names = (conversation.agent_config or {}).get("tools")
        # No list means every tool; an empty list means none (an agent that only talks).
        tools = self.tools if names is None else self.tools.subset(names)
        declared = client_tools_of(conversation, active.client_tools)
        shadowed = [t.name for t in declared if t.name in tools]
        if shadowed:
            # A server tool of that name came after the declaration (a new MCP tool): the
            # service's runs, and the client's declaration is left out, said here.
            log.warning("client tools shadowed by server tools of the same name", extra={"tools": shadowed})
        if declared:
            tools = tools.with_tools(t for t in declared if t.name not in tools)
        return self.tracing.tools(tools)

    async def _execute(
        self,
        active: ActiveRun,
        conversation: ConversationRecord,
        question: str,
        history: list[ChatMessage],
        last_id: str | None,
        resume: Resume | None,
        seen: object | None,
    ) -> None:
        """The attempt in its ``invoke_agent`` span (a no-op without tracing), with the tokens
        it used and how it ended."""
        run_id_var.set(active.run_id)
        conversation_id_var.set(active.conversation_id)
        model = active.model = self.models.resolve(active.model)
        span = self.tracing.run_span(
            run_id=active.run_id,
            conversation_id=active.conversation_id,
            attempt=active.attempt,
            model=model,
            models=self.models,
            traceparent=active.trace_parent,
        )
        tokens_before = (active.usage.prompt_tokens, active.usage.completion_tokens)
        with span:
            outcome, error = await self._attempt(
                active, model, conversation, question, history, last_id, resume, seen, span
            )
            span.outcome(
                outcome,
                error,
                active.usage.prompt_tokens - tokens_before[0],
                active.usage.completion_tokens - tokens_before[1],
            )

    async def _attempt(
        self,
        active: ActiveRun,
        model: str,
        conversation: ConversationRecord,
        question: str,
        history: list[ChatMessage],
        last_id: str | None,
        resume: Resume | None,
        seen: object | None,
        span: RunSpan | NoRunSpan,
    ) -> tuple[str, str | None]:
        """Returns how the attempt ended (the run's status, or ``lost``, ``handed_over``,
        ``waiting``) and the run's error."""
        publisher = self.publisher(
            active.conversation_id,
            active.run_id,
            last_id,
            active.attempt,
            on_lost=lambda: self.cancel_local(active, "lost"),
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
            elif isinstance(event, ApprovalRequested) or (type(event) is IterationStarted and event.client):
                if isinstance(event, ApprovalRequested):
                    span.event("agentstream.approval_requested", {"gen_ai.tool.name": event.tool_name})
                # Stored before it is announced: a decision or a result sent at once finds it.
                stored = await self.approvals.store(
                    event,
                    run_id=active.run_id,
                    conversation_id=active.conversation_id,
                    owner=conversation.owner,
                )
                if stored is None:
                    return  # settled already: announced once, when it was asked for
                event = stored
            await publisher.publish(event)

        if resume is not None:
            queue = self.interrupt_queue(active.conversation_id, resume.state.follow_up_position())
        else:
            queue = self.interrupt_queue(active.conversation_id, seen=seen)
        hooks = self.hooks()
        policy = approval_policy(self.settings, conversation)
        if policy is not None:
            hooks.add_pre(policy)

        async def fell_back(from_model: str, to_model: str) -> None:
            log.warning(
                "a call went to the model's fallback: the model stayed unavailable after its retries",
                extra={"from_model": from_model, "to_model": to_model},
            )
            span.event("agentstream.fallback", {"from_model": from_model, "to_model": to_model})
            await publisher.publish(FellBack(from_model, to_model))

        llm = self.models.for_run(model, fell_back)
        agent = ReActAgent(
            llm, self._tools_for(conversation, active), agent_config(self.settings, conversation), hooks
        )
        checkpointer = RunCheckpointer(
            publisher,
            queue,
            active.run_id,
            active.attempt,
            self.metrics,
            first_seq=1 if resume is not None else 0,
        )
        result: AgentResult | None = None
        status: str
        error: str | None = None
        try:
            if resume is not None and resume.announce:
                await publisher.publish(RunResumed(active.attempt, resume.after))
                log.info("run resumed", extra={"worker": self.worker_id, "attempt": active.attempt})
            elif resume is not None:
                log.info("run goes on after its approvals", extra={"worker": self.worker_id})
            else:
                log.info("run started", extra={"worker": self.worker_id})
            result = await agent.run(
                question,
                sink=sink,
                history=history,
                interrupts=queue,
                run_id=active.run_id,
                conversation_id=active.conversation_id,
                owner=conversation.owner,
                usage=active.usage,
                checkpointer=checkpointer,
                resume=resume.state if resume is not None else None,
                elapsed_before=time.monotonic() - active.started,
                approvals=(
                    RunApprovals(
                        active.run_id,
                        self.settings.approval_timeout_s,
                        resume.decisions if resume is not None else {},
                        self.settings.client_tool_timeout_s,
                    )
                    if (conversation.agent_config or {}).get("ask_approvals", True)
                    else None
                ),
            )
            status = result.status
            error = result.error
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            status, error = "cancelled", "cancelled by the user"
            if active.cancel_reason is None:
                # Nobody asked for it: the process is tearing down its tasks. The run goes on
                # elsewhere, it is not the user's cancel.
                active.cancel_reason = "handover"
        except Exception as exc:
            log.exception("run crashed")
            status, error = "failed", f"internal error: {type(exc).__name__}"
        active.finishing = True
        outcome = status
        try:
            if active.cancel_reason == "lost":
                outcome = "lost"
                # Another attempt holds the run now: add nothing after what it publishes (what
                # this one still had queued is dropped), and leave the conversation's queue to it.
                log.warning("run was taken over by another worker; stopped it here")
                await publisher.discard()
            elif active.cancel_reason == "handover":
                outcome = "handed_over"
                checkpointer.record_usage(active.usage, resume.state.values if resume is not None else None)
                await self._hand_over(active, publisher)
            elif result is not None and result.status == "waiting" and active.cancel_reason is None:
                outcome = "waiting"
                if not await self._park(active, publisher):
                    outcome, error = "cancelled", "cancelled by the user"
                    await self._finish(active, publisher, queue, None, [], outcome, error)
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
            self.active.pop(active.run_id, None)
            self.metrics.active_runs.dec()
            self.on_room()
        return outcome, error

    async def _hand_over(self, active: ActiveRun, publisher: RunPublisher) -> None:
        """Store what the attempt published and checkpointed, then release the run, so that
        another worker carries it on from there at once (RUNS.md R-08)."""
        await _let_go_of(publisher)
        deadline = time.monotonic() + RELEASE_RETRY_S
        while True:
            try:
                released = await self.runs.release(active.run_id, active.attempt, self.worker_id)
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    log.warning(
                        "could not release the run; its lease will run out", extra={"error": repr(exc)}
                    )
                    return
                await asyncio.sleep(0.2)
        if not released:
            log.warning("run was no longer held by this worker when it stopped")
            return
        self.metrics.handovers.inc()
        log.info("run handed over", extra={"attempt": active.attempt})
        try:
            await self.released.request(active.run_id, active.conversation_id)
        except Exception as exc:
            log.warning("could not announce the released run", extra={"error": repr(exc)})

    async def _park(self, active: ActiveRun, publisher: RunPublisher) -> bool:
        """The run waits for a person (RUNS.md A-02): its events and checkpoints stored, its row
        let go, held by no worker. False if its user cancelled it meanwhile (close it then).
        (A request whose checkpoint the store lost is asked again by the next attempt, under the
        same approval id.)"""
        await _let_go_of(publisher)
        parked = await self.approvals.park(active.run_id, active.attempt, self.worker_id)
        if parked == "cancelled":
            return False
        if parked == "lost":
            log.warning("run was no longer held by this worker when it stopped to wait")
            await publisher.discard()
        elif parked == "released":
            # Every decision came in while it was parking: it goes on at once, on some worker.
            try:
                await self.released.request(active.run_id, active.conversation_id)
            except Exception as exc:  # the claim loops find it on their next pass
                log.warning("could not announce the run that goes on", extra={"error": repr(exc)})
        log.info("run waits for approval", extra={"parked": parked})
        return True

    async def _finish(
        self,
        active: ActiveRun,
        publisher: RunPublisher,
        queue: DurableInterruptQueue,
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
        pending += await drain_quietly(queue)
        new_messages: list[ChatMessage] = []
        if result is not None:
            new_messages = list(result.messages)
            if new_messages and new_messages[0].role == "user":
                new_messages = new_messages[1:]  # the question was stored when the run started
        # Untaken follow-ups stay in the conversation for the next run.
        new_messages += follow_up_messages(pending)
        if result is not None and engine_done:
            done = replace(engine_done[-1], pending_injections=tuple(pending), model=active.model)
        else:
            done = RunDone(
                answer=result.answer if result is not None else "".join(active.answer_parts),
                iterations=result.iterations if result is not None else active.iterations,
                usage=result.usage.as_dict() if result is not None else active.usage.as_dict(),
                elapsed=time.monotonic() - active.started,
                status=status,  # type: ignore[arg-type]
                error=error,
                pending_injections=tuple(pending),
                model=active.model,
            )

        run_id, attempt, taken = active.run_id, active.attempt, queue.position

        async def close(stamped: StoredEvent) -> bool:
            return await while_unreachable(
                lambda: close_row(self.runs, run_id, attempt, conv_id, done, stamped, new_messages, taken)
            )

        finished, done_event = await close_with_done(publisher, done, close)
        if not finished:
            log.warning("run was already closed elsewhere; its done event is not sent twice")
            await publisher.discard()  # nothing of it may follow the other close's done
            return
        await publisher.publish_stored(done_event)
        self.metrics.runs.labels(done.status).inc()
        log.info("run finished", extra={"status": done.status, "iterations": done.iterations})
        with contextlib.suppress(EventPersistError):  # events missing from the log: logged already
            await publisher.close()


async def _let_go_of(publisher: RunPublisher) -> None:
    """Before an attempt lets its run go (a hand-over, a park): what it published and
    checkpointed stored, and sent to the bus for a while (followers elsewhere read what the bus
    has; the database has it all anyway)."""
    with contextlib.suppress(EventPersistError):  # logged by the publisher
        await publisher.flush_store()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(publisher.flush(), timeout=2.0)
