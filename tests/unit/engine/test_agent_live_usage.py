"""The caller's Usage is filled as calls complete, so a cancelled run still reports its cost."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.agent import ReActAgent
from app.engine.events import Usage
from app.tools.registry import Tool, ToolRegistry
from tests.support.scripted import native_tools
from tests.unit.engine.agent_support import NATIVE, EventLog, MakeLLM


async def test_usage_passed_in_is_filled_before_a_cancel(scripted_llm: MakeLLM) -> None:
    tool_started = asyncio.Event()
    never = asyncio.Event()

    async def slow(**_: object) -> str:
        tool_started.set()
        await never.wait()
        return "unreachable"

    tools = ToolRegistry.of([Tool("slow", "waits forever", {"type": "object", "properties": {}}, slow)])
    llm = scripted_llm([native_tools(("slow", {}))], abilities=NATIVE)
    usage = Usage()
    task = asyncio.create_task(ReActAgent(llm, tools).run("go", sink=EventLog(), usage=usage))
    await asyncio.wait_for(tool_started.wait(), timeout=5)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert usage.llm_calls == 1
    assert usage.total_tokens == 15  # what the one scripted reply reported
