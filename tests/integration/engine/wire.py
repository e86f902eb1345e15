"""What the engine integration tests share: abilities, an event sink, tools, and readers of request bodies.

The tests here look at two things only: the JSON bodies the engine sent over the socket (as the fake
OpenAI server recorded them) and the typed events it emitted. The readers below take a recorded body
and return its messages in the wire format, never the engine's own ``ChatMessage`` objects.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from app.engine.agent import AgentConfig, ReActAgent
from app.engine.events import EngineEvent, RunDone
from app.llm.base import LLM
from app.llm.openai_client import OpenAICompatibleLLM
from app.tools.registry import Tool, ToolRegistry

API_KEY = "sk-test-SECRET-engine-0123456789abcdef"
MODEL = "engine-test-model"
NATIVE = {"tool_call": True, "json_mode": True, "streaming": True}
JSON_ONLY = {"tool_call": False, "json_mode": False, "streaming": True}

Body = dict[str, Any]
Message = dict[str, Any]
E = TypeVar("E")
MakeLLM = Callable[..., OpenAICompatibleLLM]
"""The ``make_llm`` fixture: ``make_llm(abilities=..., timeout_s=..., max_retries=...)``."""


class RecordingSleep:
    """Stands in for ``asyncio.sleep`` between retries: waits for nothing, remembers every delay."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class EventLog:
    """The run's event sink: keeps every event in order."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []

    async def __call__(self, event: EngineEvent) -> None:
        self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def done(self) -> RunDone:
        dones = self.of(RunDone)
        assert len(dones) == 1, f"expected exactly one RunDone, got {len(dones)}"
        assert self.events[-1] is dones[0], "RunDone must be the last event"
        return dones[0]

    def wire_text(self) -> str:
        """Every event's payload as JSON, to check that some text never reached the UI."""
        return "\n".join(json.dumps(e.data(), ensure_ascii=False) for e in self.events)


def make_agent(llm: LLM, tools: ToolRegistry, **config: Any) -> ReActAgent:
    return ReActAgent(llm, tools, AgentConfig(**config))


def tool(
    name: str,
    func: Callable[..., Awaitable[str]],
    *,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
) -> Tool:
    return Tool(
        name=name,
        description=description or f"The {name} test tool.",
        parameters=parameters or {"type": "object", "properties": {}},
        func=func,
        timeout_s=timeout_s,
    )


def echo_tool(name: str = "echo") -> Tool:
    async def echo(**kwargs: Any) -> str:
        return f"{name} " + json.dumps(kwargs, sort_keys=True)

    return tool(name, echo, description=f"Echo the arguments back ({name}).")


def constant_tool(name: str, result: str) -> Tool:
    async def constant(**_: Any) -> str:
        return result

    return tool(name, constant)


def registry(*tools: Tool) -> ToolRegistry:
    return ToolRegistry.of(tools)


# -- readers of recorded request bodies ---------------------------------------------------------


def messages(body: Body) -> list[Message]:
    return list(body["messages"])


def roles(body: Body) -> list[str]:
    return [m["role"] for m in body["messages"]]


def contents(body: Body, role: str) -> list[str]:
    return [m.get("content") or "" for m in body["messages"] if m["role"] == role]


def sent_tool_names(body: Body) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or ()]


def is_stream(body: Body) -> bool:
    return bool(body.get("stream"))


def non_stream(requests: list[Body]) -> list[Body]:
    return [b for b in requests if not is_stream(b)]


def index_of(body: Body, predicate: Callable[[Message], bool]) -> int:
    for i, m in enumerate(body["messages"]):
        if predicate(m):
            return i
    raise AssertionError(f"no such message in {roles(body)}")


def assert_tool_messages_paired(body: Body) -> None:
    """Every ``tool`` message belongs to the assistant ``tool_calls`` run right before it, and every
    call of an assistant message is answered, in order, before any other message (E-06, E-16)."""
    msgs = messages(body)
    i = 0
    while i < len(msgs):
        m = msgs[i]
        assert m["role"] != "tool", f"orphan tool message at {i}: {roles(body)}"
        if m["role"] == "assistant" and m.get("tool_calls"):
            ids = [c["id"] for c in m["tool_calls"]]
            answered = [t.get("tool_call_id") for t in msgs[i + 1 : i + 1 + len(ids)]]
            assert answered == ids, f"calls {ids} answered by {answered} at {i}: {roles(body)}"
            i += 1 + len(ids)
            continue
        i += 1
