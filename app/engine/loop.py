"""Phase 1 of a run: the tool loop skeleton that JSON mode and native mode share (E-14 to E-27).

``ToolLoop`` owns the iteration: context guard, LLM call, parse, interrupt drains, tool execution
wrapped by hooks, the drift guards, the final-answer decision and the max-iterations fallback. What
differs between the modes is a small ``LoopStrategy`` (how to ask, how to parse, how observations go
back, when interrupts are drained): ``loop_json.JsonStrategy`` and ``loop_native.NativeStrategy``.

The message list only ever grows by appending (the context guard may replace it when it compacts),
so an iteration costs the same at step 50 as at step 1. The loop's state lives in a ``LoopState``
(``app.engine.state``), checkpointed as it goes, so that a new attempt of the run can carry on
from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from app.engine import prompts
from app.engine.approvals import ApprovalDecision, Approvals
from app.engine.calls import CallOutcome, ParsedReply, client_outcome, with_unique_ids
from app.engine.context import ContextGuard
from app.engine.events import (
    ApprovalDecided,
    ApprovalRequested,
    EventSink,
    Injected,
    IterationDone,
    IterationStarted,
    ThinkingDone,
    ThinkingStarted,
    Usage,
)
from app.engine.guards import CompletionChecklist, CycleDetector, ReflectionSchedule
from app.engine.hooks import HookRegistry, ToolCallContext
from app.engine.interrupts import InterruptQueue, merge_interrupts
from app.engine.state import (
    AwaitingCall,
    CallRecord,
    Journal,
    LoopOutcome,
    LoopState,
    PendingReply,
    PlannedCall,
)
from app.engine.synthesis import TraceStep
from app.engine.tool_results import artifact_payload, cap_observation, observation_of
from app.llm.base import (
    LLM,
    ChatMessage,
    ChatResult,
    LLMRequestRejectedError,
    LLMResponseError,
    LLMUnavailableError,
)
from app.tools.registry import ToolInvocation, ToolRegistry, ToolResult

logger = logging.getLogger(__name__)

MAX_BAD_REPLIES = 3
"""Consecutive malformed LLM replies (E-27) after which the run fails."""


class LoopStrategy(Protocol):
    """What differs between JSON mode and native function calling."""

    drains_before_tools: bool
    """JSON mode drains interrupts right after the assistant message (E-23); native mode only once
    the tool results follow it, because nothing may come between the two."""

    json_mode: bool

    def system_prompt(self, extra: str | None) -> str: ...

    async def ask(self, llm: LLM, messages: Sequence[ChatMessage]) -> ChatResult: ...

    def parse(self, reply: ChatResult) -> ParsedReply: ...

    def observation_messages(self, outcomes: Sequence[CallOutcome]) -> list[ChatMessage]: ...


@dataclass(slots=True)
class LoopSettings:
    max_iterations: int
    cycle_detection_threshold: int
    self_reflection_interval: int
    completion_check: bool
    completion_check_min_tools: int


def add_llm_call(usage: Usage, reply: ChatResult) -> None:
    t = reply.usage
    usage.add(Usage(t.prompt_tokens, t.completion_tokens, t.total_tokens, reply.attempts))


@dataclass(slots=True)
class ToolLoop:
    """One run's tool loop, from its first iteration or from where a checkpoint left it.

    Create a new one per attempt: every counter and guard starts from ``state``. With a
    ``journal``, a checkpoint is recorded at every safe point (RUNS.md R-01): after each LLM reply
    (with the calls it asks for), after each tool result, at the end of each iteration (after its
    drain of follow-ups), and when the loop ends.
    """

    llm: LLM
    registry: ToolRegistry
    strategy: LoopStrategy
    settings: LoopSettings
    hooks: HookRegistry
    guard: ContextGuard
    sink: EventSink
    usage: Usage
    question: str
    state: LoopState
    interrupts: InterruptQueue | None = None
    journal: Journal | None = None
    approvals: Approvals | None = None
    """Where calls that need a person's approval get it; None: nobody can approve them here."""
    run_id: str = ""
    conversation_id: str = ""
    owner: str = ""
    cycles: CycleDetector = field(init=False)
    reflection: ReflectionSchedule = field(init=False)
    checklist: CompletionChecklist = field(init=False)

    def __post_init__(self) -> None:
        s, cfg = self.state, self.settings
        self.cycles = CycleDetector(cfg.cycle_detection_threshold, counts=s.cycles)
        self.reflection = ReflectionSchedule(cfg.self_reflection_interval, tool_calls=s.reflection_calls)
        self.checklist = CompletionChecklist(
            enabled=cfg.completion_check, min_tools=cfg.completion_check_min_tools, fired=s.checklist_fired
        )

    async def run(self) -> LoopOutcome:
        outcome = await self._iterate()
        if outcome.awaiting:
            self._checkpoint()  # the run waits: its loop goes on later, from here
        else:
            self._checkpoint(outcome=outcome)
        return outcome

    async def _iterate(self) -> LoopOutcome:
        s = self.state
        limit = self.settings.max_iterations
        if s.pending is not None:
            # A new attempt, mid-iteration: the reply is known; finish what it asked for.
            outcome = await self._complete(s.pending)
            if outcome is not None:
                return outcome
        for iteration in range(s.iteration + 1, limit + 1):
            await self._guard_context()
            await self.sink(ThinkingStarted(iteration))
            try:
                reply = await self.strategy.ask(self.llm, s.messages)
            except LLMUnavailableError as exc:
                self.usage.llm_calls += exc.attempts
                await self.sink(ThinkingDone(iteration, f"(LLM unavailable: {exc})"))
                return self._outcome("", iteration, error=f"LLM unavailable: {exc}")
            except LLMRequestRejectedError as exc:
                # Sending the same request again would be refused again (bad key, unknown model...).
                self.usage.llm_calls += exc.attempts
                await self.sink(ThinkingDone(iteration, f"(LLM refused the request: {exc})"))
                return self._outcome("", iteration, error=str(exc))
            except LLMResponseError as exc:
                # A malformed reply is retried by the next iteration, which counts toward the limit.
                self.usage.llm_calls += exc.attempts
                s.bad_replies += 1
                await self.sink(ThinkingDone(iteration, f"(unusable LLM reply: {exc})"))
                if s.bad_replies >= MAX_BAD_REPLIES:
                    error = f"LLM returned {s.bad_replies} unusable replies in a row; last: {exc}"
                    return self._outcome("", iteration, error=error)
                s.iteration = iteration
                self._checkpoint()
                continue
            s.bad_replies = 0
            add_llm_call(self.usage, reply)

            parsed = self.strategy.parse(reply)
            parsed = with_unique_ids(parsed, self.state.call_ids, iteration, self._id_mark)
            await self.sink(ThinkingDone(iteration, parsed.reasoning))
            self._append(parsed.assistant, keep=parsed.kind == "tools")
            injected = await self._drain() if self.strategy.drains_before_tools else False
            pending = s.pending = PendingReply(
                iteration, parsed.kind, parsed.reasoning, parsed.answer, parsed.calls, injected
            )
            self._checkpoint()
            outcome = await self._complete(pending)
            if outcome is not None:
                return outcome

        calls = [(step.tool_name, step.error) for step in s.steps]
        return self._outcome(prompts.max_iterations_answer(limit, calls), limit, exhausted=True)

    async def _complete(self, pending: PendingReply) -> LoopOutcome | None:
        """The rest of ``pending``'s iteration: its calls, the drain, the decision. Returns the
        loop's outcome when it is over, None to go on with the next iteration."""
        s = self.state
        if pending.calls:
            awaiting = await self._run_calls(pending)
            if awaiting:
                return self._outcome("", pending.iteration - 1, awaiting=awaiting)
        injected = pending.injected
        if not self.strategy.drains_before_tools:
            injected = await self._drain()
        s.pending = None
        s.iteration = pending.iteration
        outcome = self._decide(pending, injected)
        if outcome is None:
            self._checkpoint()  # an outcome is checkpointed by run()
        return outcome

    def _decide(self, pending: PendingReply, injected: bool) -> LoopOutcome | None:
        s = self.state
        iteration, limit = pending.iteration, self.settings.max_iterations
        if pending.kind == "tools":
            s.last_unparsed = False
            return None
        if pending.kind == "unparsed" and not s.last_unparsed and iteration < limit:
            # E-08: the raw reply is already in the history; ask once for the proper format.
            # With no iteration left for that retry, the raw reply is the answer (it was
            # parsed as a final answer; the limit's fallback would throw its text away).
            s.last_unparsed = True
            self._append(ChatMessage(role="user", content=prompts.REFORMAT_INSTRUCTION), keep=False)
            return None
        # A final answer, or an unparseable reply (the second in a row, or on the last
        # iteration) whose raw text is the answer.
        accept_raw = pending.kind == "unparsed"
        s.last_unparsed = accept_raw
        if injected and iteration < limit:
            # E-25: the user said more; the pending answer is superseded. With no iteration
            # left, the answer stands and synthesis still sees the follow-ups.
            return None
        if not accept_raw and iteration < limit and self.checklist.should_fire(s.tools_used):
            checklist_text = prompts.completion_checklist(json_mode=self.strategy.json_mode)
            self._append(ChatMessage(role="user", content=checklist_text), keep=False)
            return None
        return self._outcome(pending.answer, iteration)

    def _outcome(
        self,
        answer: str,
        iterations: int,
        *,
        error: str | None = None,
        exhausted: bool = False,
        awaiting: tuple[AwaitingCall, ...] = (),
    ) -> LoopOutcome:
        s = self.state
        s.iteration = max(s.iteration, iterations)
        return LoopOutcome(
            answer=answer,
            iterations=iterations,
            steps=s.steps,
            tools_used=s.tools_used,
            follow_ups=s.follow_ups,
            error=error,
            exhausted=exhausted,
            awaiting=awaiting,
        )

    def _checkpoint(self, **extra: Any) -> None:
        if self.journal is None:
            return
        s = self.state
        s.reflection_calls = self.reflection.tool_calls
        s.checklist_fired = self.checklist.fired
        # A queue that can start from where a run left it (the service's) says how far it got.
        s.follow_up_position = getattr(self.interrupts, "position", None)
        self.journal.checkpoint(self.usage, **extra)

    @property
    def _id_mark(self) -> str:
        """A piece of the run's id for the call ids the loop makes (none without a run id)."""
        return f"{self.run_id[-6:]}_" if self.run_id else ""

    def _append(self, message: ChatMessage, *, keep: bool) -> None:
        self.state.messages.append(message)
        if keep:
            self.state.kept.append(message)

    async def _guard_context(self) -> None:
        try:
            messages, compacted = await self.guard.check_and_compact(self.state.messages, self.usage)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("context guard failed run_id=%s; continuing uncompacted", self.run_id)
            return
        self.state.messages = messages
        if compacted is not None:
            await self.sink(compacted)

    async def _drain(self) -> bool:
        """One drain: ONE pinned user message and one Injected event (E-24)."""
        if self.interrupts is None:
            return False
        try:
            contents = await self.interrupts.drain()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("interrupt drain failed run_id=%s", self.run_id)
            return False
        if not contents:
            return False
        self.state.follow_ups.extend(contents)
        self._append(ChatMessage(role="user", content=merge_interrupts(contents), pinned=True), keep=True)
        await self.sink(Injected("\n".join(contents)))
        return True

    async def _run_calls(self, pending: PendingReply) -> tuple[AwaitingCall, ...]:
        """Run the reply's calls (at once) and append their results; returns the calls that wait
        for a person instead, if any (then nothing is appended: the results follow the reply
        together, in call order, once every decision is in)."""
        calls = pending.calls
        if len(calls) == 1:
            results = [await self._run_call(pending, calls[0])]
        else:
            try:
                # A task group: if one call fails for good, the others stop too (no tool goes on
                # running for a run that has ended).
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._run_call(pending, c)) for c in calls]
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
            results = [task.result() for task in tasks]
        awaiting = tuple(
            pending.awaiting[c.call_id] for c, r in zip(calls, results, strict=True) if r is None
        )
        if awaiting:
            return awaiting
        outcomes = [r for r in results if r is not None]
        s = self.state
        # Results first, in the order of the calls, before any other message (E-06).
        for message in self.strategy.observation_messages(outcomes):
            self._append(message, keep=True)
        real = 0
        for outcome in outcomes:
            s.steps.append(
                TraceStep(outcome.call.tool_name, outcome.call.args, outcome.observation, outcome.error)
            )
            if outcome.ran:
                real += 1
            if outcome.call.args_error is None and outcome.counted:
                warning = self.cycles.record(outcome.call.tool_name, outcome.call.args)
                if warning is not None:
                    self._append(ChatMessage(role="user", content=warning), keep=False)
        s.tools_used += real
        if real and self.reflection.record(real):
            self._append(
                ChatMessage(
                    role="user", content=prompts.self_reflection(self.reflection.tool_calls, self.question)
                ),
                keep=False,
            )
        return ()

    async def _run_call(self, pending: PendingReply, call: PlannedCall) -> CallOutcome | None:
        """One call of ``pending``, its events and its record; None when it waits for a person."""
        known = pending.results.get(call.call_id)
        if known is not None:
            # Finished by an earlier attempt of the run: never run again; its events were sent.
            return CallOutcome(call, known.observation, known.error, known.ran, known.counted)
        started = time.monotonic()
        awaiting = pending.awaiting.get(call.call_id)
        decision: ApprovalDecision | None = None
        if awaiting is not None:
            decision = self.approvals.decision(call.call_id) if self.approvals is not None else None
            if decision is None:
                return None  # asked already (its request is out): still no decision
            if awaiting.client:
                return await self._client_result(pending, call, decision, started)
            await self._announce(pending, awaiting, decision)
            if decision.status != "approved":
                return await self._refused(pending, call, awaiting, decision, started)
            args = dict(decision.tool_args) if decision.tool_args is not None else awaiting.args
            call = replace(call, args=args)
        if call.call_id in pending.started and not self._repeatable(call):
            # It was running when its worker stopped: it may or may not have taken effect.
            reason = prompts.interrupted_call(call.tool_name)
            outcome = CallOutcome(call, reason, reason, ran=False)
            result = ToolResult(content="", error=reason)
            args = dict(call.args)
            await self.sink(IterationStarted(pending.iteration, call.tool_name, args, call.call_id))
        else:
            executed = await self._execute(pending, call, approved=awaiting is not None)
            if executed is None:
                return None
            outcome, result = executed
        if awaiting is not None and call.args != awaiting.args:
            # The model asked for other arguments: it reads which ones ran.
            observation = prompts.edited_call(call.tool_name, call.args, outcome.observation)
            outcome = replace(outcome, observation=observation)
        return await self._done(pending, outcome, result, started)

    async def _done(
        self,
        pending: PendingReply,
        outcome: CallOutcome,
        result: ToolResult,
        started: float,
        *,
        client: bool = False,
    ) -> CallOutcome:
        call, iteration = outcome.call, pending.iteration
        await self.sink(
            IterationDone(
                iteration=iteration,
                tool_name=call.tool_name,
                observation=cap_observation(outcome.observation),
                error=outcome.error,
                iter_elapsed=time.monotonic() - started,
                artifact=artifact_payload(result),
                call_id=call.call_id,
                client=client,
            )
        )
        pending.results[call.call_id] = CallRecord(
            outcome.observation, outcome.error, outcome.ran, outcome.counted
        )
        self._checkpoint()
        return outcome

    async def _announce(
        self, pending: PendingReply, awaiting: AwaitingCall, decision: ApprovalDecision
    ) -> None:
        """The decision's ``approval`` event, once per call (a new attempt does not repeat it)."""
        if awaiting.call_id in pending.decided:
            return
        args = dict(decision.tool_args) if decision.tool_args is not None else awaiting.args
        status = "expired" if decision.status == "expired" else decision.status
        assert status != "answered"  # a client's result is no decision to announce
        await self.sink(ApprovalDecided(awaiting.approval_id, status, decision.reason, args))
        pending.decided.add(awaiting.call_id)
        self._checkpoint()

    async def _refused(
        self,
        pending: PendingReply,
        call: PlannedCall,
        awaiting: AwaitingCall,
        decision: ApprovalDecision,
        started: float,
    ) -> CallOutcome:
        """A call a person denied, or nobody decided in time: it does not run (A-03, A-04)."""
        reason = prompts.denied_call(call.tool_name, decision.reason, expired=decision.status == "expired")
        args = dict(awaiting.args)
        await self.sink(IterationStarted(pending.iteration, call.tool_name, args, call.call_id))
        outcome = CallOutcome(call, reason, reason, ran=False, counted=False)
        return await self._done(pending, outcome, ToolResult(content="", error=reason), started)

    async def _client_result(
        self, pending: PendingReply, call: PlannedCall, decision: ApprovalDecision, started: float
    ) -> CallOutcome:
        """A call of a tool the client runs, as its result came (or did not in time; C-03)."""
        outcome, result = client_outcome(call, decision)
        return await self._done(pending, outcome, result, started, client=True)

    async def _ask(
        self, pending: PendingReply, call: PlannedCall, args: dict[str, Any], *, client: bool = False
    ) -> None:
        """Record ``call`` as waiting for a person (A-02), or, ``client``, for the result of the
        tool the client runs (C-02), and ask."""
        assert self.approvals is not None
        if self.journal is not None:
            # As for an idempotency key: the approval is asked for only once the reply that names
            # the call is stored, so a new attempt asks for this very call, never another one.
            await self.journal.durable()
        iteration = pending.iteration
        ticket = self.approvals.ticket(call.call_id, call.tool_name, args, iteration, client=client)
        awaiting = AwaitingCall(
            call.call_id, ticket.approval_id, ticket.expires_at, call.tool_name, args, iteration, client
        )
        if client:
            await self.sink(
                IterationStarted(
                    iteration,
                    call.tool_name,
                    args,
                    call.call_id,
                    client=True,
                    expires_at=ticket.expires_at,
                    approval_id=ticket.approval_id,
                )
            )
        else:
            await self.sink(
                ApprovalRequested(
                    ticket.approval_id, call.call_id, call.tool_name, args, iteration, ticket.expires_at
                )
            )
        pending.awaiting[call.call_id] = awaiting
        self._checkpoint()

    def _repeatable(self, call: PlannedCall) -> bool:
        tool = self.registry.get(call.tool_name)
        return tool is None or tool.idempotent or call.args_error is not None

    async def _execute(
        self, pending: PendingReply, call: PlannedCall, *, approved: bool
    ) -> tuple[CallOutcome, ToolResult] | None:
        """The call's PreToolUse hooks, its start event and the tool; None when a hook asks for a
        person's approval (the call waits, and runs in a later attempt)."""
        iteration = pending.iteration
        if call.args_error is not None:
            await self.sink(IterationStarted(iteration, call.tool_name, dict(call.args), call.call_id))
            result = ToolResult(content="", error=call.args_error)
            return CallOutcome(call, observation_of(result), result.error, ran=False), result
        ctx = ToolCallContext(
            run_id=self.run_id,
            conversation_id=self.conversation_id,
            iteration=pending.iteration,
            tool_name=call.tool_name,
            tool_args=call.args,
            tool=self.registry.get(call.tool_name),
            call_id=call.call_id,
            idempotency_key=f"{self.run_id}:{call.call_id}",
            owner=self.owner,
            approved=approved,
        )
        decision = await self.hooks.run_pre(ctx)
        if decision.allow and ctx.tool is not None and ctx.tool.client:
            # A tool the client runs: its application, the user's, answers for it (C-02).
            args = dict(decision.args) if decision.args is not None else dict(call.args)
            if self.approvals is not None:
                await self._ask(pending, call, args, client=True)
                return None
            decision = replace(decision, allow=False, reason=prompts.client_call_unavailable(call.tool_name))
        elif decision.allow and decision.ask:
            args = dict(decision.args) if decision.args is not None else dict(call.args)
            if self.approvals is not None:
                await self._ask(pending, call, args)
                return None
            # Nobody can approve it in this run: it does not run, and the model is told why.
            decision = replace(decision, allow=False, reason=prompts.approval_unavailable(call.tool_name))
        await self.sink(IterationStarted(iteration, call.tool_name, dict(call.args), call.call_id))
        if not decision.allow:
            reason = decision.reason or "Blocked by a PreToolUse hook."
            # E-17: the hook's reason itself is what the model reads.
            return CallOutcome(call, reason, reason, ran=False), ToolResult(content="", error=reason)
        if decision.args is not None:
            ctx = replace(ctx, tool_args=dict(decision.args))
        keyed = ctx.tool is not None and ctx.tool.takes_invocation
        if self.journal is not None and (keyed or not self._repeatable(call)):
            if not self._repeatable(call):
                # Stored before the tool starts: a new attempt must know that it may have run.
                pending.started.add(call.call_id)
                self._checkpoint()
            # A call's idempotency key is handed out only once the reply that names the call is
            # stored: a new attempt then carries on with that very call, and never gives the key
            # to a different call of a reply it asked for again.
            await self.journal.durable()
        invocation = ToolInvocation(
            idempotency_key=ctx.idempotency_key,
            owner=self.owner,
            run_id=self.run_id,
            conversation_id=self.conversation_id,
            call_id=call.call_id,
        )
        result = await self.registry.execute(call.tool_name, ctx.tool_args, invocation=invocation)
        result = await self.hooks.run_post(ctx, result)
        return CallOutcome(call, observation_of(result), result.error, ran=ctx.tool is not None), result
