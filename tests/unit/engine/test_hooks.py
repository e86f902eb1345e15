"""PreToolUse / PostToolUse hooks and the built-in ones (E-17, E-18)."""

from __future__ import annotations

from typing import Any

import pytest

from app.engine.events import IterationDone, IterationStarted
from app.engine.hooks import (
    AuditHook,
    AuditRecord,
    HookRegistry,
    PreToolDecision,
    ReadOnlyGuard,
    ToolCallContext,
    ToolRateLimit,
)
from app.tools.registry import Tool, ToolResult
from tests.support.scripted import json_final, json_tool, native_tools, text
from tests.unit.engine.agent_support import (
    JSON_ONLY,
    NATIVE,
    EventLog,
    MakeLLM,
    answer,
    echo_tool,
    make_agent,
    make_tool,
    registry,
    user_texts,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Block:
    def __init__(self, reason: str | None = "Waiting for human approval.") -> None:
        self.reason = reason
        self.seen: list[str] = []

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        self.seen.append(ctx.tool_name)
        return PreToolDecision(allow=False, reason=self.reason)


class Rewrite:
    def __init__(self, **extra: Any) -> None:
        self.extra = extra
        self.seen: list[dict[str, Any]] = []

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        self.seen.append(dict(ctx.tool_args))
        return PreToolDecision(args={**ctx.tool_args, **self.extra})


class Shorten:
    async def post_tool_use(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult | None:
        return ToolResult(content=result.content[:10] + " [shortened]", error=result.error)


class Recorder:
    def __init__(self) -> None:
        self.pre: list[ToolCallContext] = []
        self.post: list[tuple[ToolCallContext, ToolResult]] = []

    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        self.pre.append(ctx)
        return None

    async def post_tool_use(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult | None:
        self.post.append((ctx, result))
        return None


class Explode:
    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        raise RuntimeError("policy store down")

    async def post_tool_use(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult | None:
        raise RuntimeError("redactor down")


async def _write(**_: object) -> str:
    return "written"


def write_tool() -> Tool:
    return make_tool("write", _write, writes=True)


def ctx(
    tool: Tool | None = None, *, name: str = "echo", conversation: str = "c1", **args: Any
) -> ToolCallContext:
    return ToolCallContext("r1", conversation, 1, tool.name if tool else name, args, tool, call_id="k1")


# HookRegistry


async def test_blocking_pre_hook_reason_is_the_observation_and_the_tool_does_not_run(
    scripted_llm: MakeLLM,
) -> None:
    ran: list[str] = []

    async def guarded(**_: object) -> str:
        ran.append("ran")
        return "secret"

    llm = scripted_llm([native_tools(("guarded", {})), text("ok"), answer()], abilities=NATIVE)
    log = EventLog()

    result = await make_agent(
        llm, registry(make_tool("guarded", guarded)), hooks=HookRegistry(pre=[Block()])
    ).run("q", sink=log)

    assert ran == []
    tool_message = next(m for m in llm.calls[1].messages if m.role == "tool")
    assert tool_message.content == "Waiting for human approval."
    done = log.of(IterationDone)[0]
    assert (done.observation, done.error) == ("Waiting for human approval.", "Waiting for human approval.")
    assert result.tools_used == 0


async def test_pre_hook_rewrites_arguments_before_execution(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([json_tool("echo", {"q": "x"}), json_final("ok"), answer()], abilities=JSON_ONLY)
    log = EventLog()
    hooks = HookRegistry(pre=[Rewrite(limit=5), Rewrite(page=2)])

    await make_agent(llm, hooks=hooks).run("q", sink=log)

    assert hooks.pre[1].seen == [{"q": "x", "limit": 5}]  # type: ignore[attr-defined]
    assert log.of(IterationStarted)[0].tool_args == {"q": "x"}  # what the model asked
    assert log.of(IterationDone)[0].observation == 'echo {"limit": 5, "page": 2, "q": "x"}'


async def test_post_hook_rewrites_what_the_llm_sees(scripted_llm: MakeLLM) -> None:
    async def big(**_: object) -> str:
        return "0123456789abcdef" * 100

    llm = scripted_llm([json_tool("big", {}), json_final("ok"), answer()], abilities=JSON_ONLY)

    await make_agent(llm, registry(make_tool("big", big)), hooks=HookRegistry(post=[Shorten()])).run(
        "q", sink=EventLog()
    )

    assert user_texts(llm.calls[1].messages)[-1] == "Observation from `big`:\n0123456789 [shortened]"


async def test_hooks_wrap_calls_to_unknown_tools(scripted_llm: MakeLLM) -> None:
    recorder = Recorder()
    hooks = HookRegistry()
    hooks.add(recorder)
    llm = scripted_llm([native_tools(("ghost", {"a": 1})), text("ok"), answer()], abilities=NATIVE)

    await make_agent(llm, hooks=hooks).run("q", sink=EventLog(), run_id="run-7", conversation_id="conv-3")

    (pre,) = recorder.pre
    assert (pre.tool_name, pre.tool, pre.run_id, pre.conversation_id, pre.iteration) == (
        "ghost",
        None,
        "run-7",
        "conv-3",
        1,
    )
    assert pre.call_id == "call_0_ghost"
    (post_ctx, post_result) = recorder.post[0]
    assert post_ctx.call_id == pre.call_id
    assert post_result.error is not None and "not found" in post_result.error


async def test_first_blocking_hook_wins_and_later_pre_hooks_do_not_run() -> None:
    later = Recorder()
    hooks = HookRegistry(pre=[Block("no"), later])

    decision = await hooks.run_pre(ctx())

    assert decision == PreToolDecision(allow=False, reason="no")
    assert later.pre == []


async def test_block_without_reason_names_the_hook() -> None:
    decision = await HookRegistry(pre=[Block(reason=None)]).run_pre(ctx())

    assert decision.reason == "Blocked by Block."


async def test_failing_hooks_fail_closed() -> None:
    hooks = HookRegistry()
    hooks.add(Explode())

    decision = await hooks.run_pre(ctx())
    result = await hooks.run_post(ctx(), ToolResult(content="password=hunter2"))

    assert not decision.allow and "policy store down" in (decision.reason or "")
    assert result.error is not None and "redactor down" in result.error
    assert "hunter2" not in result.content


async def test_add_rejects_objects_that_are_not_hooks() -> None:
    with pytest.raises(TypeError):
        HookRegistry().add(object())


# ReadOnlyGuard


async def test_read_only_guard_blocks_tools_that_write(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([native_tools(("write", {}), ("echo", {})), text("ok"), answer()], abilities=NATIVE)
    log = EventLog()

    await make_agent(llm, registry(write_tool(), echo_tool()), hooks=HookRegistry(pre=[ReadOnlyGuard()])).run(
        "q", sink=log
    )

    blocked, allowed = log.of(IterationDone)
    assert blocked.error is not None and "read-only mode" in blocked.error
    assert allowed.error is None


async def test_read_only_guard_lets_unknown_and_reading_tools_through() -> None:
    guard = ReadOnlyGuard()

    assert await guard.pre_tool_use(ctx(echo_tool())) is None
    assert await guard.pre_tool_use(ctx(None, name="ghost")) is None


# AuditHook


async def test_audit_hook_records_ok_error_and_blocked_calls(scripted_llm: MakeLLM) -> None:
    clock = FakeClock()
    audit = AuditHook(clock=clock)
    hooks = HookRegistry()
    hooks.add(audit)
    hooks.add_pre(ReadOnlyGuard())

    async def slow_echo(**kwargs: Any) -> str:
        clock.now += 2.5
        return "fine"

    tools = registry(make_tool("slow_echo", slow_echo), write_tool())
    llm = scripted_llm(
        [
            native_tools(("slow_echo", {"x": 1})),
            native_tools(("write", {"y": 2}), ("ghost", {})),
            text("ok"),
            answer(),
        ],
        abilities=NATIVE,
    )

    await make_agent(llm, tools, hooks=hooks).run("q", sink=EventLog(), run_id="r9", conversation_id="c9")

    ok, blocked, missing = audit.records
    assert ok == AuditRecord("r9", "c9", "slow_echo", {"x": 1}, "ok", None, 2.5)
    assert (blocked.tool_name, blocked.outcome, blocked.args) == ("write", "blocked", {"y": 2})
    assert blocked.error is not None and "read-only" in blocked.error
    assert (missing.tool_name, missing.outcome) == ("ghost", "error")


async def test_audit_hook_sends_records_to_an_async_callback() -> None:
    received: list[AuditRecord] = []

    async def store(record: AuditRecord) -> None:
        received.append(record)

    audit = AuditHook(store)
    hooks = HookRegistry()
    hooks.add(audit)
    call = ctx(echo_tool(), q="x")

    await hooks.run_pre(call)
    await hooks.run_post(call, ToolResult(content="", error="timed out"))

    assert [(r.outcome, r.error, r.args) for r in received] == [("error", "timed out", {"q": "x"})]
    assert audit.records == []


# ToolRateLimit


async def test_rate_limit_blocks_beyond_max_calls_in_the_window_per_conversation() -> None:
    clock = FakeClock()
    limit = ToolRateLimit(2, 60, clock=clock)

    first = await limit.pre_tool_use(ctx(conversation="a"))
    clock.now += 10
    second = await limit.pre_tool_use(ctx(conversation="a"))
    third = await limit.pre_tool_use(ctx(conversation="a"))
    other = await limit.pre_tool_use(ctx(conversation="b"))

    assert first is None and second is None and other is None
    assert third is not None and not third.allow
    assert "at most 2 tool calls per 60s" in (third.reason or "")
    assert "50.0s" in (third.reason or "")


async def test_rate_limit_window_slides() -> None:
    clock = FakeClock()
    limit = ToolRateLimit(1, 30, clock=clock)

    assert await limit.pre_tool_use(ctx()) is None
    clock.now += 29.9
    assert await limit.pre_tool_use(ctx()) is not None
    clock.now += 0.2
    assert await limit.pre_tool_use(ctx()) is None


async def test_rate_limit_blocks_within_one_native_reply(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [native_tools(("echo", {"i": 1}), ("echo", {"i": 2}), ("echo", {"i": 3})), text("ok"), answer()],
        abilities=NATIVE,
    )
    log = EventLog()
    hooks = HookRegistry(pre=[ToolRateLimit(2, 60, clock=FakeClock())])

    await make_agent(llm, hooks=hooks).run("q", sink=log, conversation_id="c")

    errors = [e.error for e in log.of(IterationDone) if e.error is not None]
    assert len(errors) == 1 and errors[0].startswith("Rate limit reached")
    tool_messages = [m.content or "" for m in llm.calls[1].messages if m.role == "tool"]
    assert sum(t.startswith("Rate limit reached") for t in tool_messages) == 1


def test_rate_limit_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        ToolRateLimit(0, 10)
