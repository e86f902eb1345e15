"""An in-process scripted LLM for unit tests.

Each call pops the next scripted reply; calling it more times than scripted fails the test at once,
and ``assert_exhausted()`` (called by the fixture at teardown) fails it if fewer calls were made.
Every call's messages and keyword arguments are recorded for assertions.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.llm.base import (
    ChatMessage,
    ChatResult,
    StreamEnd,
    StreamItem,
    TextDelta,
    TokenUsage,
    ToolCall,
)


@dataclass
class RecordedCall:
    kind: str  # "chat" or "stream"
    messages: list[ChatMessage]
    kwargs: dict[str, Any]


@dataclass
class StreamScript:
    """A scripted streaming reply: these deltas, then ``error`` raised (if set) or a clean end."""

    deltas: Sequence[str]
    error: Exception | None = None
    usage: TokenUsage = field(default_factory=lambda: TokenUsage(10, 5, 15))
    finish_reason: str | None = "stop"


Reply = ChatResult | Exception | StreamScript | Callable[[list[ChatMessage], dict[str, Any]], Any]


def text(
    content: str, *, reasoning_content: str | None = None, usage: TokenUsage | None = None
) -> ChatResult:
    return ChatResult(
        content=content, reasoning_content=reasoning_content, usage=usage or TokenUsage(10, 5, 15)
    )


def json_reply(obj: Mapping[str, Any], **kw: Any) -> ChatResult:
    return text(json.dumps(obj), **kw)


def json_tool(name: str, args: Mapping[str, Any], reasoning: str = "") -> ChatResult:
    return json_reply(
        {"type": "tool_call", "tool_name": name, "tool_args": dict(args), "reasoning": reasoning}
    )


def json_final(answer: str, reasoning: str = "") -> ChatResult:
    return json_reply({"type": "final_answer", "answer": answer, "reasoning": reasoning})


def native_tools(*calls: tuple[str, Mapping[str, Any]], content: str | None = None) -> ChatResult:
    tcs = tuple(
        ToolCall(id=f"call_{i}_{name}", name=name, arguments=json.dumps(dict(args)))
        for i, (name, args) in enumerate(calls)
    )
    return ChatResult(
        content=content, tool_calls=tcs, usage=TokenUsage(10, 5, 15), finish_reason="tool_calls"
    )


class ScriptedLLM:
    def __init__(
        self,
        replies: Sequence[Reply],
        *,
        abilities: Mapping[str, bool] | None = None,
        model_name: str = "scripted",
    ) -> None:
        self._replies = list(replies)
        self._abilities = dict(abilities or {"tool_call": True, "json_mode": True, "streaming": True})
        self._model_name = model_name
        self.calls: list[RecordedCall] = []

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self._abilities

    @property
    def model_name(self) -> str:
        return self._model_name

    def _next(self, kind: str, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Reply:
        self.calls.append(RecordedCall(kind, list(messages), kwargs))
        if not self._replies:
            raise AssertionError(
                f"ScriptedLLM called more times than scripted (call #{len(self.calls)}, {kind})"
            )
        reply = self._replies.pop(0)
        if callable(reply) and not isinstance(reply, (ChatResult, StreamScript, Exception)):
            reply = reply(list(messages), kwargs)
        return reply

    async def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        reply = self._next("chat", messages, kwargs)
        if isinstance(reply, Exception):
            raise reply
        if not isinstance(reply, ChatResult):
            raise AssertionError(f"scripted a {type(reply).__name__} for a chat() call")
        return reply

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        reply = self._next("stream", messages, {})
        if isinstance(reply, Exception):
            raise reply
        if not isinstance(reply, StreamScript):
            raise AssertionError(f"scripted a {type(reply).__name__} for a stream_chat() call")
        for d in reply.deltas:
            yield TextDelta(d)
        if reply.error is not None:
            raise reply.error
        yield StreamEnd(reply.usage, finish_reason=reply.finish_reason)

    @property
    def remaining(self) -> int:
        return len(self._replies)

    def assert_exhausted(self) -> None:
        if self._replies:
            raise AssertionError(f"ScriptedLLM: {len(self._replies)} scripted replies were never requested")
