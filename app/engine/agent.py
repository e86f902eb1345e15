"""``ReActAgent``: one run = optional tool selection, the tool loop, then streamed synthesis.

The agent binds one LLM instance for every call of a run (E-02) and picks the mode once (E-07). It
reports progress only through typed events to the sink and always ends with exactly one ``RunDone``;
``run()`` never raises except ``asyncio.CancelledError`` (the run manager owns cancellation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from app.engine.approvals import Approvals
from app.engine.context import ContextGuard
from app.engine.events import AnswerSignalled, EventSink, PhaseChanged, RunDone, RunWaiting, Usage
from app.engine.hooks import HookRegistry
from app.engine.interrupts import InterruptQueue
from app.engine.loop import LoopSettings, LoopStrategy, ToolLoop
from app.engine.loop_json import JsonStrategy
from app.engine.loop_native import NativeStrategy
from app.engine.selection import select_tools
from app.engine.state import AwaitingCall, Checkpointer, Journal, LoopOutcome, LoopState, RunCheckpoint
from app.engine.synthesis import synthesize
from app.llm.base import LLM, ChatMessage
from app.tools.registry import ToolRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _RunIds:
    run_id: str
    conversation_id: str
    owner: str


@dataclass
class AgentConfig:
    max_iterations: int = 50
    use_native_tools: bool = True
    completion_check: bool = True
    completion_check_min_tools: int = 3
    cycle_detection_threshold: int = 3
    self_reflection_interval: int = 6
    tool_selection_threshold: int = 12
    tool_selection_max: int = 6
    context_token_budget: int = 32000
    synthesis_result_chars: int = 2000
    system_prompt: str | None = None
    """Extra instructions prepended to the loop's system prompt (and given to synthesis)."""


@dataclass
class AgentResult:
    answer: str
    iterations: int
    usage: Usage
    elapsed: float
    status: Literal["completed", "failed", "waiting"]
    error: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    """The run's new messages, in order, to keep as history: the question, assistant tool-call
    messages, tool results / observations, injected interrupts and the final answer. Engine nudges
    (reflection, cycle warning, checklist, reformat) are left out."""
    pending_injections: list[str] = field(default_factory=list)
    """Interrupts that arrived after the loop had finished (E-25); the caller decides what to do."""
    tools_used: int = 0
    awaiting: tuple[AwaitingCall, ...] = ()
    """Status ``waiting``: the calls that wait for a person's decision (RUNS.md A-02). The run is
    checkpointed and goes on, in a new attempt, once every decision is in; no ``done`` was sent."""


class ReActAgent:
    def __init__(
        self,
        llm: LLM,
        tools: ToolRegistry,
        config: AgentConfig | None = None,
        hooks: HookRegistry | None = None,
    ) -> None:
        self._llm = llm
        self._tools = tools
        self._config = config or AgentConfig()
        self._hooks = hooks or HookRegistry()

    @property
    def config(self) -> AgentConfig:
        return self._config

    @property
    def native_mode_active(self) -> bool:
        """E-07: native function calling needs both the agent's consent and the model's ability."""
        return self._config.use_native_tools and bool(self._llm.abilities.get("tool_call", False))

    async def run(
        self,
        question: str,
        *,
        sink: EventSink,
        history: Sequence[ChatMessage] = (),
        interrupts: InterruptQueue | None = None,
        run_id: str = "",
        conversation_id: str = "",
        owner: str = "",
        usage: Usage | None = None,
        checkpointer: Checkpointer | None = None,
        resume: RunCheckpoint | None = None,
        elapsed_before: float = 0.0,
        approvals: Approvals | None = None,
    ) -> AgentResult:
        """Run the loop and synthesis; ``usage``, when given, is added to as calls complete, so a
        caller that cancels the run still knows what the calls made so far cost.

        With a ``checkpointer`` the run's progress is checkpointed at every safe point; ``resume``
        (the run's checkpoints, folded) carries on a run from where its last attempt left it, on
        the same ``question`` and ``history``. ``elapsed_before`` is the time the run took before
        this attempt (its ``done`` reports the whole). ``approvals``: where calls that need a
        person's approval get it; without, such calls do not run (the model is told why). A run
        that waits for a decision returns status ``waiting`` and sends no ``done``."""
        started = time.monotonic() - elapsed_before
        usage = usage if usage is not None else Usage()
        kept: list[ChatMessage] = []
        try:
            result = await self._run(
                question,
                sink=sink,
                history=history,
                interrupts=interrupts,
                ids=_RunIds(run_id, conversation_id, owner),
                usage=usage,
                kept=kept,
                started=started,
                checkpointer=checkpointer,
                resume=resume,
                approvals=approvals,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A bug or a failing sink must still end the run with a done event, not a traceback.
            logger.exception("run crashed run_id=%s conversation_id=%s", run_id, conversation_id)
            result = AgentResult(
                answer="",
                iterations=0,
                usage=usage,
                elapsed=time.monotonic() - started,
                status="failed",
                error=f"internal error: {type(exc).__name__}: {exc}",
                messages=kept,
                pending_injections=await _drain_quietly(interrupts, run_id),
            )
        if result.status == "waiting":
            return result
        try:
            await sink(
                RunDone(
                    answer=result.answer,
                    iterations=result.iterations,
                    usage=usage.as_dict(),
                    elapsed=result.elapsed,
                    status=result.status,
                    error=result.error,
                    pending_injections=tuple(result.pending_injections),
                )
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("could not deliver the done event run_id=%s", run_id)
        return result

    async def _run(
        self,
        question: str,
        *,
        sink: EventSink,
        history: Sequence[ChatMessage],
        interrupts: InterruptQueue | None,
        ids: _RunIds,
        usage: Usage,
        kept: list[ChatMessage],
        started: float,
        checkpointer: Checkpointer | None,
        resume: RunCheckpoint | None,
        approvals: Approvals | None,
    ) -> AgentResult:
        cfg = self._config
        run_id = ids.run_id
        resume = resume if resume is not None and not resume.empty else None
        selected = resume.selected if resume is not None else None
        if selected is not None:
            registry = self._tools.subset(selected)
        else:
            registry = await self._select_tools(question, sink, usage, run_id)
        strategy: LoopStrategy = (
            NativeStrategy(registry) if self.native_mode_active else JsonStrategy(registry)
        )

        question_message = ChatMessage(role="user", content=question, pinned=True)
        initial = [
            ChatMessage(role="system", content=strategy.system_prompt(cfg.system_prompt)),
            *history,
            question_message,
        ]
        if resume is not None:
            state = resume.loop_state(initial)
        else:
            state = LoopState(messages=initial, kept=[question_message])
        kept[:] = state.kept
        state.kept = kept  # the caller's list: what a crash of the engine still keeps
        journal: Journal | None = None
        if checkpointer is not None:
            journal = Journal(checkpointer, state, restored=resume is not None)
            if resume is None:
                journal.start(len(initial))
            journal.selected = selected
            if selected is None and len(self._tools) > cfg.tool_selection_threshold:
                # Selection ran (whatever it kept): a new attempt uses its choice, not a new one.
                journal.selected = registry.names()
                journal.checkpoint(usage, selected=journal.selected)

        outcome = resume.loop_outcome() if resume is not None else None
        if outcome is None:
            loop = ToolLoop(
                llm=self._llm,
                registry=registry,
                strategy=strategy,
                settings=LoopSettings(
                    max_iterations=max(1, cfg.max_iterations),
                    cycle_detection_threshold=cfg.cycle_detection_threshold,
                    self_reflection_interval=cfg.self_reflection_interval,
                    completion_check=cfg.completion_check,
                    completion_check_min_tools=cfg.completion_check_min_tools,
                ),
                hooks=self._hooks,
                guard=ContextGuard(self._llm, cfg.context_token_budget),
                sink=sink,
                usage=usage,
                question=question,
                state=state,
                interrupts=interrupts,
                journal=journal,
                approvals=approvals,
                run_id=run_id,
                conversation_id=ids.conversation_id,
                owner=ids.owner,
            )
            outcome = await loop.run()
            if outcome.awaiting:
                await sink(
                    RunWaiting(
                        tuple(a.approval_id for a in outcome.awaiting if not a.client),
                        tuple(a.call_id for a in outcome.awaiting if a.client),
                    )
                )
                return AgentResult(
                    answer="",
                    iterations=outcome.iterations,
                    usage=usage,
                    elapsed=time.monotonic() - started,
                    status="waiting",
                    messages=kept,
                    tools_used=outcome.tools_used,
                    awaiting=outcome.awaiting,
                )
        if outcome.error is not None:
            return await self._finish(
                outcome,
                "",
                usage=usage,
                kept=kept,
                started=started,
                interrupts=interrupts,
                run_id=run_id,
                error=outcome.error,
            )

        await sink(AnswerSignalled())
        synthesis = await synthesize(
            self._llm,
            question=question,
            steps=outcome.steps,
            loop_answer=outcome.answer,
            sink=sink,
            usage=usage,
            result_chars=cfg.synthesis_result_chars,
            # Half the context budget for the trace: the rest is the question, the follow-ups,
            # the draft answer, the instructions and the reply.
            trace_tokens=cfg.context_token_budget // 2,
            follow_ups=outcome.follow_ups,
            instructions=cfg.system_prompt,
        )
        kept.append(ChatMessage(role="assistant", content=synthesis.answer))
        return await self._finish(
            outcome,
            synthesis.answer,
            usage=usage,
            kept=kept,
            started=started,
            interrupts=interrupts,
            run_id=run_id,
            error=synthesis.error,
        )

    async def _select_tools(self, question: str, sink: EventSink, usage: Usage, run_id: str) -> ToolRegistry:
        """E-12/E-13: narrow a large registry before the loop; any failure keeps every tool."""
        if len(self._tools) <= self._config.tool_selection_threshold:
            return self._tools
        await sink(PhaseChanged("selecting_tools", len(self._tools)))
        try:
            return await select_tools(
                self._llm, question, self._tools, usage=usage, max_tools=self._config.tool_selection_max
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("tool selection failed run_id=%s; using every tool", run_id)
            return self._tools

    async def _finish(
        self,
        outcome: LoopOutcome,
        answer: str,
        *,
        usage: Usage,
        kept: list[ChatMessage],
        started: float,
        interrupts: InterruptQueue | None,
        run_id: str,
        error: str | None,
    ) -> AgentResult:
        pending = await _drain_quietly(interrupts, run_id)
        return AgentResult(
            answer=answer,
            iterations=outcome.iterations,
            usage=usage,
            elapsed=time.monotonic() - started,
            status="failed" if outcome.error is not None else "completed",
            error=error,
            messages=kept,
            pending_injections=pending,
            tools_used=outcome.tools_used,
        )


async def _drain_quietly(interrupts: InterruptQueue | None, run_id: str) -> list[str]:
    """Messages that came too late for the loop are handed back, never dropped (E-25)."""
    if interrupts is None:
        return []
    try:
        return await interrupts.drain()
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("interrupt drain failed run_id=%s", run_id)
        return []
