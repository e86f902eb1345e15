"""Builders for the provider-shape integration tests (``test_provider_*.py``): chunks, event
streams and completions served byte for byte by the fake server, and what a stream yielded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from app.llm.base import ChatMessage, StreamEnd, StreamItem, TextDelta
from tests.support.fake_replies import FakeReply

API_KEY = "sk-test-SECRET-0123456789abcdef"
QUESTION = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="9.11 or 9.8?")]
ABILITIES = {"tool_call": True, "json_mode": True, "streaming": True}


class RecordingSleep:
    """Stands in for asyncio.sleep so retries do not wait; remembers every delay asked for."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0, **top: Any
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": choices, **top}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(*chunks: object, done: bool = True) -> FakeReply:
    """A 200 event stream of exactly these chunks (and ``[DONE]`` unless told otherwise)."""
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return FakeReply.malformed(
        body + (b"data: [DONE]\n\n" if done else b""), content_type="text/event-stream"
    )


def raw_stream(text: str) -> FakeReply:
    return FakeReply.malformed(text.encode(), content_type="text/event-stream")


def reply(*choices: dict[str, Any], **top: Any) -> FakeReply:
    """A 200 JSON completion with exactly these choices."""
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": list(choices), **top}
    return FakeReply.malformed(orjson.dumps(body))


def choice(message: dict[str, Any], finish: str | None = "stop", index: int = 0) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", **message}, "finish_reason": finish}


def call(
    call_id: str | None, name: str = "calculator", arguments: Any = '{"expression":"2+2"}'
) -> dict[str, Any]:
    raw: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        raw["id"] = call_id
    return raw


async def collect(stream: AsyncIterator[StreamItem]) -> list[StreamItem]:
    return [item async for item in stream]


def texts(items: list[StreamItem]) -> list[str]:
    return [item.text for item in items if isinstance(item, TextDelta)]


def end(items: list[StreamItem]) -> StreamEnd:
    assert isinstance(items[-1], StreamEnd)
    return items[-1]
