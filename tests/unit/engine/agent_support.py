"""Shared pieces of the agent tests: an event log sink, a test interrupt queue, tiny tools."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from app.engine.agent import AgentConfig, ReActAgent
from app.engine.events import EngineEvent, RunDone
from app.engine.hooks import HookRegistry
from app.llm.base import ChatMessage
from app.tools.registry import Tool, ToolFunc, ToolRegistry
from tests.support.scripted import ScriptedLLM, StreamScript

MakeLLM = Callable[..., ScriptedLLM]
NATIVE = {"tool_call": True, "json_mode": True, "streaming": True}
JSON_ONLY = {"tool_call": False, "json_mode": False, "streaming": True}

E = TypeVar("E")


class EventLog:
    """An in-memory sink."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []

    async def __call__(self, event: EngineEvent) -> None:
        self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    @property
    def done(self) -> RunDone:
        dones = self.of(RunDone)
        assert len(dones) == 1, f"expected exactly one RunDone, got {len(dones)}"
        assert self.events[-1] is dones[0], "RunDone must be the last event"
        return dones[0]


class PushQueue:
    """An InterruptQueue that a synchronous scripted reply can feed (``push``)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.drains = 0

    def push(self, *contents: str) -> None:
        self.items.extend(contents)

    async def put(self, content: str) -> int:
        self.items.append(content)
        return len(self.items)

    async def drain(self) -> list[str]:
        self.drains += 1
        items, self.items = self.items, []
        return items


def make_tool(
    name: str,
    func: ToolFunc,
    *,
    description: str | None = None,
    writes: bool = False,
    timeout_s: float = 5.0,
) -> Tool:
    return Tool(
        name=name,
        description=description or f"The {name} test tool.",
        parameters={"type": "object", "properties": {}},
        func=func,
        writes=writes,
        timeout_s=timeout_s,
    )


async def _echo(**kwargs: Any) -> str:
    return "echo " + json.dumps(kwargs, sort_keys=True)


async def _add(a: int, b: int) -> str:
    return str(a + b)


async def _boom(**_: Any) -> str:
    raise RuntimeError("kaboom")


def echo_tool(name: str = "echo") -> Tool:
    return make_tool(name, _echo, description=f"{name}: echo the arguments back.")


def add_tool() -> Tool:
    return Tool(
        name="add",
        description="Add two integers.",
        parameters={
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        func=_add,
    )


def boom_tool() -> Tool:
    return make_tool("boom", _boom)


def registry(*tools: Tool) -> ToolRegistry:
    return ToolRegistry.of(tools)


def make_agent(
    llm: ScriptedLLM,
    tools: ToolRegistry | None = None,
    *,
    hooks: HookRegistry | None = None,
    **config: Any,
) -> ReActAgent:
    return ReActAgent(
        llm, tools if tools is not None else registry(echo_tool()), AgentConfig(**config), hooks
    )


def answer(*deltas: str) -> StreamScript:
    return StreamScript(list(deltas) or ["Final answer."])


def user_texts(messages: list[ChatMessage]) -> list[str]:
    return [m.content or "" for m in messages if m.role == "user"]


def roles(messages: list[ChatMessage]) -> list[str]:
    return [m.role for m in messages]


def last_call_messages(llm: ScriptedLLM, kind: str = "chat") -> list[ChatMessage]:
    return [c for c in llm.calls if c.kind == kind][-1].messages


def args_of(mapping: Mapping[str, Any]) -> str:
    return json.dumps(dict(mapping), sort_keys=True)
