"""Native function calling: parallel calls, tool message ordering, unusable arguments (E-06, E-27)."""

from __future__ import annotations

import asyncio

from app.engine.events import IterationDone, IterationStarted
from app.llm.base import ChatResult, TokenUsage, ToolCall
from app.tools.registry import ToolFunc
from tests.support.scripted import native_tools, text
from tests.unit.engine.agent_support import (
    NATIVE,
    EventLog,
    MakeLLM,
    PushQueue,
    add_tool,
    answer,
    echo_tool,
    make_agent,
    make_tool,
    registry,
    roles,
)


async def test_native_passes_tool_schemas_in_the_tools_parameter(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text("no tools needed"), answer()], abilities=NATIVE)

    await make_agent(llm, registry(add_tool())).run("q", sink=EventLog())

    tools = llm.calls[0].kwargs["tools"]
    assert [t["function"]["name"] for t in tools] == ["add"]
    assert tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert "Parameters (JSON Schema)" not in (llm.calls[0].messages[0].content or "")


async def test_native_parallel_tool_results_follow_their_assistant_message_before_any_interrupt(
    scripted_llm: MakeLLM,
) -> None:
    queue = PushQueue()
    arrived = {"left": asyncio.Event(), "right": asyncio.Event()}

    def meeting(me: str, other: str) -> ToolFunc:
        async def run(**_: object) -> str:
            # Each call waits for the other: only a parallel execution can finish.
            arrived[me].set()
            await arrived[other].wait()
            if me == "left":
                queue.push("stop, use metric units")
            return f"{me} done"

        return run

    tools = registry(
        make_tool("left", meeting("left", "right"), timeout_s=2),
        make_tool("right", meeting("right", "left"), timeout_s=2),
    )
    llm = scripted_llm([native_tools(("left", {}), ("right", {})), text("ok"), answer()], abilities=NATIVE)
    log = EventLog()

    await make_agent(llm, tools).run("q", sink=log, interrupts=queue)

    assert [e.error for e in log.of(IterationDone)] == [None, None]
    second = llm.calls[1].messages
    assert roles(second)[-4:] == ["assistant", "tool", "tool", "user"]
    assistant, first_tool, second_tool, interrupt = second[-4:]
    assert [tc.id for tc in assistant.tool_calls] == [first_tool.tool_call_id, second_tool.tool_call_id]
    assert (first_tool.content, second_tool.content) == ("left done", "right done")
    assert interrupt.content == "[USER INTERRUPT] stop, use metric units" and interrupt.pinned


async def test_native_tool_messages_keep_call_order_when_later_calls_finish_first(
    scripted_llm: MakeLLM,
) -> None:
    slow_may_finish = asyncio.Event()

    async def slow(**_: object) -> str:
        await slow_may_finish.wait()
        return "slow"

    async def fast(**_: object) -> str:
        slow_may_finish.set()
        return "fast"

    tools = registry(make_tool("slow", slow, timeout_s=2), make_tool("fast", fast))
    llm = scripted_llm([native_tools(("slow", {}), ("fast", {})), text("ok"), answer()], abilities=NATIVE)

    await make_agent(llm, tools).run("q", sink=EventLog())

    tool_messages = [m for m in llm.calls[1].messages if m.role == "tool"]
    assert [(m.name, m.content) for m in tool_messages] == [("slow", "slow"), ("fast", "fast")]


async def test_native_invalid_tool_arguments_become_an_error_observation_for_that_call(
    scripted_llm: MakeLLM,
) -> None:
    calls = (
        ToolCall(id="c1", name="echo", arguments="{not json"),
        ToolCall(id="c2", name="echo", arguments="[1, 2]"),
        ToolCall(id="c3", name="echo", arguments='{"ok": true}'),
    )
    reply = ChatResult(content=None, tool_calls=calls, usage=TokenUsage(1, 1, 2))
    llm = scripted_llm([reply, text("done"), answer()], abilities=NATIVE)
    log = EventLog()

    result = await make_agent(llm, registry(echo_tool())).run("q", sink=log)

    errors = [e.error for e in log.of(IterationDone)]
    assert errors[0] is not None and "not valid JSON" in errors[0]
    assert errors[1] is not None and "expected a JSON object" in errors[1]
    assert errors[2] is None
    tool_messages = [m for m in llm.calls[1].messages if m.role == "tool"]
    assert [m.tool_call_id for m in tool_messages] == ["c1", "c2", "c3"]
    assert (tool_messages[0].content or "").startswith("Error: Invalid arguments for tool 'echo'")
    assert result.tools_used == 1


async def test_native_empty_arguments_mean_no_arguments(scripted_llm: MakeLLM) -> None:
    reply = ChatResult(content=None, tool_calls=(ToolCall(id="c1", name="echo", arguments=""),))
    llm = scripted_llm([reply, text("done"), answer()], abilities=NATIVE)
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert log.of(IterationStarted)[0].tool_args == {}
    assert log.of(IterationDone)[0].error is None


async def test_native_reply_without_tool_calls_is_the_final_answer(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text("Just this."), answer("Just this, polished.")], abilities=NATIVE)
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log)

    assert "## Draft answer\nJust this." in (llm.calls[1].messages[-1].content or "")
    assert result.iterations == 1 and result.answer == "Just this, polished."
