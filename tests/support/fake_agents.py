"""Handlers for the fake OpenAI server that play an agent model (``tests.support.fake_openai``).

``EchoAgentBehaviour`` answers every loop call with a final answer echoing the question (native
and JSON mode) and streams a fixed multi-token answer; ``ToolAgentBehaviour`` asks for one tool
first. ``MODES`` names them for ``python -m tests.support.fake_openai --mode``. The request readers
here (``is_json_protocol_call``, ``forced_function``, ...) serve test handlers of their own too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import orjson

from tests.support.fake_openai import FakeReply
from tests.support.fake_replies import Handler, UsageSpec


def iter_stream_text(raw: bytes) -> Iterator[str]:
    """Content deltas of a raw SSE body in the OpenAI format (for tests that read bytes themselves)."""
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            obj = orjson.loads(line[6:])
            for choice in obj.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    yield content


# -- behaviours: handlers that play a well-behaved agent model ---------------------------------


def _last_user_text(body: Mapping[str, Any]) -> str:
    for msg in reversed(body.get("messages") or ()):
        if isinstance(msg, Mapping) and msg.get("role") == "user" and isinstance(msg.get("content"), str):
            return str(msg["content"])
    return ""


def _system_text(body: Mapping[str, Any]) -> str:
    return "\n".join(
        str(msg.get("content") or "")
        for msg in body.get("messages") or ()
        if isinstance(msg, Mapping) and msg.get("role") == "system"
    )


def is_json_protocol_call(body: Mapping[str, Any]) -> bool:
    """A JSON-mode loop call: the system prompt describes the ``tool_call``/``final_answer`` actions."""
    system = _system_text(body)
    return "final_answer" in system and "tool_call" in system


def _forced_function(body: Mapping[str, Any]) -> str | None:
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def _has_tool_result(body: Mapping[str, Any]) -> bool:
    for msg in body.get("messages") or ():
        if not isinstance(msg, Mapping):
            continue
        if msg.get("role") == "tool" or (msg.get("role") == "assistant" and msg.get("tool_calls")):
            return True
        if msg.get("role") == "assistant" and '"tool_call"' in str(msg.get("content") or ""):
            return True
    return False


def answer_tokens(count: int) -> list[str]:
    """``count`` word deltas of a fixed answer, for streams of any length."""
    words = ["The", "fake", "model", "streams", "this", "answer", "one", "token", "at", "a", "time."]
    return [("" if i == 0 else " ") + words[i % len(words)] for i in range(count)]


class EchoAgentBehaviour:
    """A handler that plays an agent model which never needs tools.

    Loop calls get a final answer echoing the question (native: plain content; JSON mode: a
    ``final_answer`` object); streaming calls get a fixed multi-token answer (pre-encoded once);
    forced function calls and JSON-object calls get ``{"tools": []}``-style empty objects.
    """

    def __init__(
        self,
        tokens: Sequence[str] | int = 8,
        *,
        delay_s: float = 0.0,
        usage: UsageSpec = (10, 5),
    ) -> None:
        self.tokens = answer_tokens(tokens) if isinstance(tokens, int) else list(tokens)
        self.answer = "".join(self.tokens)
        self._stream = FakeReply.stream(self.tokens, delay_s=delay_s, usage=usage)
        self._usage = usage

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        if body.get("stream"):
            return self._stream
        forced = _forced_function(body)
        if forced is not None:
            return FakeReply.tool_calls([(forced, {"tools": []})], usage=self._usage)
        return self.loop_reply(body)

    def final_text(self, body: Mapping[str, Any]) -> str:
        question = _last_user_text(body).strip()
        return f"Echo: {question[:200]}"

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        text = self.final_text(body)
        if is_json_protocol_call(body):
            action = {"type": "final_answer", "answer": text, "reasoning": "Nothing to look up."}
            return FakeReply.text(orjson.dumps(action).decode(), usage=self._usage)
        if (body.get("response_format") or {}).get("type") == "json_object":
            return FakeReply.text('{"tools": []}', usage=self._usage)
        return FakeReply.text(text, usage=self._usage)


class ToolAgentBehaviour(EchoAgentBehaviour):
    """Like ``EchoAgentBehaviour``, but the first loop call of a conversation asks for one tool."""

    def __init__(
        self,
        tool_name: str = "calculator",
        tool_args: Mapping[str, Any] | None = None,
        tokens: Sequence[str] | int = 8,
        *,
        delay_s: float = 0.0,
        usage: UsageSpec = (10, 5),
    ) -> None:
        super().__init__(tokens, delay_s=delay_s, usage=usage)
        self.tool_name = tool_name
        self.tool_args = dict(tool_args if tool_args is not None else {"expression": "6*7"})

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        if _has_tool_result(body):
            return super().loop_reply(body)
        if is_json_protocol_call(body):
            action = {
                "type": "tool_call",
                "tool_name": self.tool_name,
                "tool_args": self.tool_args,
                "reasoning": f"Use {self.tool_name}.",
            }
            return FakeReply.text(orjson.dumps(action).decode(), usage=self._usage)
        if body.get("tools"):
            return FakeReply.tool_calls([(self.tool_name, self.tool_args)], usage=self._usage)
        return super().loop_reply(body)


def behaviour_echo_agent(tokens: Sequence[str] | int = 8, *, delay_s: float = 0.0) -> EchoAgentBehaviour:
    return EchoAgentBehaviour(tokens, delay_s=delay_s)


def behaviour_tool_agent(
    tool_name: str = "calculator",
    tool_args: Mapping[str, Any] | None = None,
    tokens: Sequence[str] | int = 8,
    *,
    delay_s: float = 0.0,
) -> ToolAgentBehaviour:
    return ToolAgentBehaviour(tool_name, tool_args, tokens, delay_s=delay_s)


MODES: dict[str, Callable[[argparse.Namespace], Handler]] = {
    "echo": lambda a: behaviour_echo_agent(a.tokens, delay_s=a.delay_s),
    "tool": lambda a: behaviour_tool_agent(tokens=a.tokens, delay_s=a.delay_s),
    "error": lambda a: lambda body: FakeReply.error(503),
    "ratelimit": lambda a: lambda body: FakeReply.error(429, headers={"retry-after": "1"}),
}
