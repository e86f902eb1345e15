"""PreToolUse / PostToolUse hook points (E-17, E-18) and the hooks users ask for.

Hooks run outside the LLM's control: the loop calls them around every tool execution, whatever the
model says. A PreToolUse hook may block (the reason becomes the observation), ask for a person's
approval (RUNS.md A-01: the run waits for the decision), rewrite the arguments, or cause side
effects; a PostToolUse hook may rewrite the observation.

``HookRegistry`` runs them in registration order. A hook that raises fails closed (the call is
blocked, or its result replaced by an error): a policy that cannot be evaluated must not be skipped.
Built-in hooks: ``ReadOnlyGuard``, ``AuditHook``, ``ToolRateLimit``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from app.tools.registry import Tool, ToolResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    run_id: str
    conversation_id: str
    iteration: int
    tool_name: str
    tool_args: Mapping[str, Any]
    tool: Tool | None
    """None when the model named a tool that does not exist."""
    call_id: str = ""
    """Identifies one call across its pre and post hooks (parallel calls share an iteration)."""
    idempotency_key: str = ""
    """``"<run_id>:<call_id>"``: the same for a call repeated by a new attempt of the run (R-05)."""
    owner: str = ""
    approved: bool = False
    """A person approved this call (A-03): a hook's ``ask`` is answered already."""


@dataclass(frozen=True, slots=True)
class PreToolDecision:
    allow: bool = True
    reason: str | None = None
    args: Mapping[str, Any] | None = None
    """Replacement arguments, or None to keep them."""
    ask: bool = False
    """Allowed only once a person approves it (A-01); a block of another hook still wins."""


class PreToolUseHook(Protocol):
    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None: ...


class PostToolUseHook(Protocol):
    async def post_tool_use(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult | None:
        """Return a replacement result, or None to keep it."""
        ...


@runtime_checkable
class ToolBlockedHook(Protocol):
    """Optional: told when some PreToolUse hook blocked a call (so an audit can record it)."""

    async def tool_blocked(self, ctx: ToolCallContext, reason: str) -> None: ...


@runtime_checkable
class ToolAwaitingHook(Protocol):
    """Optional: told when a call waits for a person's approval instead of running."""

    async def tool_awaiting(self, ctx: ToolCallContext, reason: str) -> None: ...


def _hook_name(hook: object) -> str:
    return type(hook).__name__


@dataclass(slots=True)
class HookRegistry:
    """The hooks of one agent; the loop calls ``run_pre`` and ``run_post`` around every tool call."""

    pre: list[PreToolUseHook] = field(default_factory=list)
    post: list[PostToolUseHook] = field(default_factory=list)

    def add_pre(self, hook: PreToolUseHook) -> None:
        self.pre.append(hook)

    def add_post(self, hook: PostToolUseHook) -> None:
        self.post.append(hook)

    def add(self, hook: object) -> None:
        """Register a hook at every point it implements (e.g. ``AuditHook`` is both)."""
        found = False
        if callable(getattr(hook, "pre_tool_use", None)):
            self.pre.append(hook)  # type: ignore[arg-type]
            found = True
        if callable(getattr(hook, "post_tool_use", None)):
            self.post.append(hook)  # type: ignore[arg-type]
            found = True
        if not found:
            raise TypeError(f"{_hook_name(hook)} implements neither pre_tool_use nor post_tool_use")

    async def run_pre(self, ctx: ToolCallContext) -> PreToolDecision:
        """Run every PreToolUse hook; the first block wins, argument rewrites chain, and an ``ask``
        of any hook (unless the call is approved already) makes the decision an ``ask``."""
        args = ctx.tool_args
        rewritten = False
        ask: str | None = None
        for hook in self.pre:
            current = replace(ctx, tool_args=args) if rewritten else ctx
            try:
                decision = await hook.pre_tool_use(current)
            except Exception as exc:
                logger.exception(
                    "pre_tool_use hook failed run_id=%s hook=%s tool=%s",
                    ctx.run_id,
                    _hook_name(hook),
                    ctx.tool_name,
                )
                decision = PreToolDecision(
                    allow=False, reason=f"PreToolUse hook {_hook_name(hook)} failed: {exc}"
                )
            if decision is None:
                continue
            if not decision.allow:
                reason = decision.reason or f"Blocked by {_hook_name(hook)}."
                await self._notify(ToolBlockedHook, "tool_blocked", current, reason)
                return PreToolDecision(allow=False, reason=reason)
            if decision.ask and not ctx.approved and ask is None:
                ask = decision.reason or f"{_hook_name(hook)} asks for a person's approval."
            if decision.args is not None:
                args = dict(decision.args)
                rewritten = True
        if ask is not None:
            await self._notify(ToolAwaitingHook, "tool_awaiting", replace(ctx, tool_args=args), ask)
            return PreToolDecision(allow=True, args=args if rewritten else None, ask=True, reason=ask)
        return PreToolDecision(allow=True, args=args if rewritten else None)

    async def run_post(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult:
        """Run every PostToolUse hook; each sees the result as rewritten by the previous ones."""
        for hook in self.post:
            try:
                replacement = await hook.post_tool_use(ctx, result)
            except Exception as exc:
                logger.exception(
                    "post_tool_use hook failed run_id=%s hook=%s tool=%s",
                    ctx.run_id,
                    _hook_name(hook),
                    ctx.tool_name,
                )
                replacement = ToolResult(
                    content="", error=f"PostToolUse hook {_hook_name(hook)} failed: {exc}"
                )
            if replacement is not None:
                result = replacement
        return result

    async def _notify(self, kind: type, method: str, ctx: ToolCallContext, reason: str) -> None:
        """Tell every hook that implements ``kind`` (once each) what became of the call."""
        seen: set[int] = set()
        for hook in [*self.pre, *self.post]:
            if id(hook) in seen or not isinstance(hook, kind):
                continue
            seen.add(id(hook))
            try:
                await getattr(hook, method)(ctx, reason)
            except Exception:
                logger.exception("%s hook failed run_id=%s hook=%s", method, ctx.run_id, _hook_name(hook))


class ReadOnlyGuard:
    """Blocks every tool marked ``writes=True``: the agent may look, not change anything."""

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        if ctx.tool is not None and ctx.tool.writes:
            return PreToolDecision(
                allow=False,
                reason=(
                    f"Tool '{ctx.tool_name}' was not executed: this agent runs in read-only mode and "
                    "that tool changes data. Use a read-only tool or answer without it."
                ),
            )
        return None


AuditOutcome = Literal["ok", "error", "blocked", "awaiting_approval"]


@dataclass(frozen=True, slots=True)
class AuditRecord:
    run_id: str
    conversation_id: str
    tool_name: str
    args: dict[str, Any]
    outcome: AuditOutcome
    error: str | None
    elapsed: float
    """Seconds from the audit's PreToolUse to the result (or the block)."""


AuditCallback = Callable[[AuditRecord], Awaitable[None]]


class AuditHook:
    """Records every tool call, blocked ones included, into a callback or ``records``.

    Register it with ``HookRegistry.add`` (it is both a pre and a post hook); register it first so
    that its clock starts before other hooks run.
    """

    def __init__(
        self, on_record: AuditCallback | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._on_record = on_record
        self._clock = clock
        self._started: dict[tuple[str, str, int, str], float] = {}
        self.records: list[AuditRecord] = []

    @staticmethod
    def _key(ctx: ToolCallContext) -> tuple[str, str, int, str]:
        return (ctx.run_id, ctx.call_id, ctx.iteration, ctx.tool_name)

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        self._started[self._key(ctx)] = self._clock()
        return None

    async def post_tool_use(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult | None:
        await self._record(ctx, "ok" if result.ok else "error", result.error)
        return None

    async def tool_blocked(self, ctx: ToolCallContext, reason: str) -> None:
        await self._record(ctx, "blocked", reason)

    async def tool_awaiting(self, ctx: ToolCallContext, reason: str) -> None:
        await self._record(ctx, "awaiting_approval", None)

    async def _record(self, ctx: ToolCallContext, outcome: AuditOutcome, error: str | None) -> None:
        started = self._started.pop(self._key(ctx), None)
        elapsed = 0.0 if started is None else max(0.0, self._clock() - started)
        record = AuditRecord(
            run_id=ctx.run_id,
            conversation_id=ctx.conversation_id,
            tool_name=ctx.tool_name,
            args=dict(ctx.tool_args),
            outcome=outcome,
            error=error,
            elapsed=elapsed,
        )
        if self._on_record is None:
            self.records.append(record)
        else:
            await self._on_record(record)


class ToolRateLimit:
    """At most ``max_calls`` tool calls per ``per_seconds`` (sliding window) in one conversation."""

    def __init__(
        self, max_calls: int, per_seconds: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_calls < 1 or per_seconds <= 0:
            raise ValueError("ToolRateLimit needs max_calls >= 1 and per_seconds > 0")
        self._max_calls = max_calls
        self._per_seconds = per_seconds
        self._clock = clock
        self._calls: dict[str, deque[float]] = {}

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        # No await between the check and the append: parallel calls of one reply cannot both slip in.
        now = self._clock()
        window = self._calls.setdefault(ctx.conversation_id, deque())
        while window and window[0] <= now - self._per_seconds:
            window.popleft()
        if len(window) >= self._max_calls:
            retry_in = window[0] + self._per_seconds - now
            return PreToolDecision(
                allow=False,
                reason=(
                    f"Rate limit reached: at most {self._max_calls} tool calls per {self._per_seconds:g}s "
                    f"in this conversation. Tool '{ctx.tool_name}' was not executed; it may be retried in "
                    f"{retry_in:.1f}s, or answer with the information you already have."
                ),
            )
        window.append(now)
        return None


__all__ = [
    "AuditCallback",
    "AuditHook",
    "AuditOutcome",
    "AuditRecord",
    "HookRegistry",
    "PostToolUseHook",
    "PreToolDecision",
    "PreToolUseHook",
    "ReadOnlyGuard",
    "ToolAwaitingHook",
    "ToolBlockedHook",
    "ToolCallContext",
    "ToolRateLimit",
]
