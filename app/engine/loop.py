"""Phase 1 of a run: the tool loop skeleton that JSON mode and native mode share (E-14 to E-27).

``ToolLoop`` owns the iteration: context guard, LLM call, parse, interrupt drains, tool execution
wrapped by hooks, the drift guards, the final-answer decision and the max-iterations fallback. What
differs between the modes is a small ``LoopStrategy`` (how to ask, how to parse, how observations go
back, when interrupts are drained): ``loop_json.JsonStrategy`` and ``loop_native.NativeStrategy``.

The message list only ever grows by appending (the context guard may replace it when it compacts),
so an iteration costs the same at step 50 as at step 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from app.engine import prompts
from app.engine.context import ContextGuard
from app.engine.events import (
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
from app.engine.synthesis import TraceStep
from app.llm.base import (
    LLM,
    ChatMessage,
    ChatResult,
    LLMRequestRejectedError,
    LLMResponseError,
    LLMUnavailableError,
)
from app.tools.registry import ToolRegistry, ToolResult

logger = logging.getLogger(__name__)

EVENT_OBSERVATION_CHARS = 8000
"""IterationDone carries at most this much of an observation; the LLM still sees all of it."""

MAX_BAD_REPLIES = 3
"""Consecutive malformed LLM replies (E-27) after which the run fails."""


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """A tool call the model asked for."""

    call_id: str
    tool_name: str
    args: dict[str, Any]
    args_error: str | None = None
    """Set when the model's arguments were unusable (not JSON, not an object): the call is not run."""


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """One LLM reply, read by a strategy.

    ``tools``: run ``calls``. ``final``: the model is done, ``answer`` is its answer. ``unparsed``
    (JSON mode only, E-08): ``answer`` holds the raw content.
    """

    kind: Literal["tools", "final", "unparsed"]
    reasoning: str
    assistant: ChatMessage
    calls: tuple[PlannedCall, ...] = ()
    answer: str = ""


@dataclass(frozen=True, slots=True)
class CallOutcome:
    call: PlannedCall
    observation: str
    """Exactly what the LLM sees."""
    error: str | None
    ran: bool
    """The tool really executed (not blocked, arguments usable, tool exists): a "real" tool call."""


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


@dataclass(slots=True)
class LoopOutcome:
    answer: str
    iterations: int
    steps: list[TraceStep]
    tools_used: int
    follow_ups: list[str]
    """Interrupt texts injected during the loop, for synthesis."""
    error: str | None = None
    """Set when the loop could not reach a usable LLM: the run fails."""
    exhausted: bool = False
    """True when ``max_iterations`` ran out and ``answer`` is the E-15 fallback."""


def add_llm_call(usage: Usage, reply: ChatResult) -> None:
    t = reply.usage
    usage.add(Usage(t.prompt_tokens, t.completion_tokens, t.total_tokens, reply.attempts))


def cap_observation(text: str, limit: int = EVENT_OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… [truncated {len(text) - limit} characters for display]"


def artifact_payload(result: ToolResult) -> dict[str, str] | None:
    """The artifact as the UI previews it (its full body), for IterationDone."""
    a = result.artifact
    if a is None or result.error is not None:
        return None
    return {"filename": a.filename, "mime_type": a.mime_type, "content": a.content}


def observation_of(result: ToolResult) -> str:
    """The text the LLM sees for a tool result (E-26): errors say so, artifacts become a marker."""
    if result.error is not None:
        return f"Error: {result.error}"
    if result.artifact is not None:
        note = result.content.strip() if result.content != result.artifact.content else ""
        return prompts.artifact_observation(result.artifact.filename, note)
    return result.content if result.content.strip() else "(the tool returned no output)"


@dataclass(slots=True)
class ToolLoop:
    """One run's tool loop. Create a new one per run: every counter and guard starts at zero."""

    llm: LLM
    registry: ToolRegistry
    strategy: LoopStrategy
    settings: LoopSettings
    hooks: HookRegistry
    guard: ContextGuard
    sink: EventSink
    usage: Usage
    question: str
    messages: list[ChatMessage]
    """What the LLM sees, system prompt first."""
    kept: list[ChatMessage]
    """The run's messages worth keeping as history: no engine nudges, no superseded answers."""
    interrupts: InterruptQueue | None = None
    run_id: str = ""
    conversation_id: str = ""
    steps: list[TraceStep] = field(default_factory=list)
    follow_ups: list[str] = field(default_factory=list)
    tools_used: int = 0

    async def run(self) -> LoopOutcome:
        cycles = CycleDetector(self.settings.cycle_detection_threshold)
        reflection = ReflectionSchedule(self.settings.self_reflection_interval)
        checklist = CompletionChecklist(
            enabled=self.settings.completion_check, min_tools=self.settings.completion_check_min_tools
        )
        limit = self.settings.max_iterations
        bad_replies = 0
        last_unparsed = False
        for iteration in range(1, limit + 1):
            await self._guard_context()
            await self.sink(ThinkingStarted(iteration))
            try:
                reply = await self.strategy.ask(self.llm, self.messages)
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
                bad_replies += 1
                await self.sink(ThinkingDone(iteration, f"(unusable LLM reply: {exc})"))
                if bad_replies >= MAX_BAD_REPLIES:
                    error = f"LLM returned {bad_replies} unusable replies in a row; last: {exc}"
                    return self._outcome("", iteration, error=error)
                continue
            bad_replies = 0
            add_llm_call(self.usage, reply)

            parsed = self.strategy.parse(reply)
            await self.sink(ThinkingDone(iteration, parsed.reasoning))
            self._append(parsed.assistant, keep=parsed.kind == "tools")

            injected = await self._drain() if self.strategy.drains_before_tools else False
            if parsed.calls:
                await self._run_calls(iteration, parsed.calls, cycles, reflection)
            if not self.strategy.drains_before_tools:
                injected = await self._drain()

            if parsed.kind == "tools":
                last_unparsed = False
                continue
            if parsed.kind == "unparsed" and not last_unparsed and iteration < limit:
                # E-08: the raw reply is already in the history; ask once for the proper format.
                # With no iteration left for that retry, the raw reply is the answer (it was
                # parsed as a final answer; the limit's fallback would throw its text away).
                last_unparsed = True
                self._append(ChatMessage(role="user", content=prompts.REFORMAT_INSTRUCTION), keep=False)
                continue
            # A final answer, or an unparseable reply (the second in a row, or on the last
            # iteration) whose raw text is the answer.
            accept_raw = parsed.kind == "unparsed"
            last_unparsed = accept_raw
            if injected and iteration < limit:
                # E-25: the user said more; the pending answer is superseded. With no iteration
                # left, the answer stands and synthesis still sees the follow-ups.
                continue
            if not accept_raw and iteration < limit and checklist.should_fire(self.tools_used):
                checklist_text = prompts.completion_checklist(json_mode=self.strategy.json_mode)
                self._append(ChatMessage(role="user", content=checklist_text), keep=False)
                continue
            return self._outcome(parsed.answer, iteration)

        calls = [(s.tool_name, s.error) for s in self.steps]
        return self._outcome(prompts.max_iterations_answer(limit, calls), limit, exhausted=True)

    def _outcome(
        self, answer: str, iterations: int, *, error: str | None = None, exhausted: bool = False
    ) -> LoopOutcome:
        return LoopOutcome(
            answer=answer,
            iterations=iterations,
            steps=self.steps,
            tools_used=self.tools_used,
            follow_ups=self.follow_ups,
            error=error,
            exhausted=exhausted,
        )

    def _append(self, message: ChatMessage, *, keep: bool) -> None:
        self.messages.append(message)
        if keep:
            self.kept.append(message)

    async def _guard_context(self) -> None:
        try:
            messages, compacted = await self.guard.check_and_compact(self.messages, self.usage)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("context guard failed run_id=%s; continuing uncompacted", self.run_id)
            return
        self.messages = messages
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
        self.follow_ups.extend(contents)
        self._append(ChatMessage(role="user", content=merge_interrupts(contents), pinned=True), keep=True)
        await self.sink(Injected("\n".join(contents)))
        return True

    async def _run_calls(
        self,
        iteration: int,
        calls: Sequence[PlannedCall],
        cycles: CycleDetector,
        reflection: ReflectionSchedule,
    ) -> None:
        if len(calls) == 1:
            outcomes = [await self._run_call(iteration, calls[0])]
        else:
            outcomes = list(await asyncio.gather(*(self._run_call(iteration, c) for c in calls)))
        # Results first, in the order of the calls, before any other message (E-06).
        for message in self.strategy.observation_messages(outcomes):
            self._append(message, keep=True)
        real = 0
        for outcome in outcomes:
            self.steps.append(
                TraceStep(outcome.call.tool_name, outcome.call.args, outcome.observation, outcome.error)
            )
            if outcome.ran:
                real += 1
            if outcome.call.args_error is None:
                warning = cycles.record(outcome.call.tool_name, outcome.call.args)
                if warning is not None:
                    self._append(ChatMessage(role="user", content=warning), keep=False)
        self.tools_used += real
        if real and reflection.record(real):
            self._append(
                ChatMessage(
                    role="user", content=prompts.self_reflection(reflection.tool_calls, self.question)
                ),
                keep=False,
            )

    async def _run_call(self, iteration: int, call: PlannedCall) -> CallOutcome:
        await self.sink(IterationStarted(iteration, call.tool_name, dict(call.args)))
        started = time.monotonic()
        outcome, result = await self._execute(iteration, call)
        await self.sink(
            IterationDone(
                iteration=iteration,
                tool_name=call.tool_name,
                observation=cap_observation(outcome.observation),
                error=outcome.error,
                iter_elapsed=time.monotonic() - started,
                artifact=artifact_payload(result),
            )
        )
        return outcome

    async def _execute(self, iteration: int, call: PlannedCall) -> tuple[CallOutcome, ToolResult]:
        if call.args_error is not None:
            result = ToolResult(content="", error=call.args_error)
            return CallOutcome(call, observation_of(result), result.error, ran=False), result
        ctx = ToolCallContext(
            run_id=self.run_id,
            conversation_id=self.conversation_id,
            iteration=iteration,
            tool_name=call.tool_name,
            tool_args=call.args,
            tool=self.registry.get(call.tool_name),
            call_id=call.call_id,
        )
        decision = await self.hooks.run_pre(ctx)
        if not decision.allow:
            reason = decision.reason or "Blocked by a PreToolUse hook."
            # E-17: the hook's reason itself is what the model reads.
            return CallOutcome(call, reason, reason, ran=False), ToolResult(content="", error=reason)
        if decision.args is not None:
            ctx = replace(ctx, tool_args=dict(decision.args))
        result = await self.registry.execute(call.tool_name, ctx.tool_args)
        result = await self.hooks.run_post(ctx, result)
        return CallOutcome(call, observation_of(result), result.error, ran=ctx.tool is not None), result


def json_args_error(tool_name: str, raw: str, problem: str) -> str:
    shown = raw if len(raw) <= 200 else raw[:199] + "…"
    return f"Invalid arguments for tool '{tool_name}': {problem}. Received: {shown}"


def decode_args(tool_name: str, raw: object) -> tuple[dict[str, Any], str | None]:
    """Tool arguments the model sent (JSON text or an object) -> (args, error) (E-27)."""
    if raw is None:
        return {}, None
    if isinstance(raw, Mapping):
        return dict(raw), None
    if isinstance(raw, str):
        if not raw.strip():
            return {}, None
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            return {}, json_args_error(tool_name, raw, f"not valid JSON ({exc})")
        if isinstance(value, dict):
            return value, None
        return {}, json_args_error(tool_name, raw, "expected a JSON object")
    return {}, json_args_error(tool_name, repr(raw), "expected a JSON object")
