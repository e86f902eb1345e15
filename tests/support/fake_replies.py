"""The replies of the fake OpenAI server (``tests.support.fake_openai``): ``FakeReply`` and how one
is rendered as a JSON completion or as the chunks of a stream.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

ReplyKind = Literal["text", "tool_calls", "stream", "error", "hang", "malformed", "no_choices", "blocked"]
Handler = Callable[[dict[str, Any]], "FakeReply"]
UsageSpec = tuple[int, int] | Mapping[str, int] | None

_CREATED = 1_700_000_000
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_WORD_RE = re.compile(r"\s*\S+|\s+")


def split_words(text: str) -> list[str]:
    """``text`` cut into word-sized deltas whose concatenation is exactly ``text``."""
    return _WORD_RE.findall(text)


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _usage_dict(spec: UsageSpec, prompt_text: str, completion_text: str) -> dict[str, int]:
    if spec is None:
        prompt, completion = _estimate_tokens(prompt_text), _estimate_tokens(completion_text)
    elif isinstance(spec, tuple):
        prompt, completion = spec
    else:
        prompt, completion = int(spec.get("prompt_tokens", 0)), int(spec.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _messages_text(body: Mapping[str, Any]) -> str:
    parts: list[str] = []
    for msg in body.get("messages") or ():
        if isinstance(msg, Mapping) and isinstance(msg.get("content"), str):
            parts.append(msg["content"])
    return "\n".join(parts)


def _chunked(frame: bytes) -> bytes:
    """One frame as an HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(frame), frame)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """A complete (non-streamed) HTTP response the server writes in one go."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StreamPlan:
    """A streamed response: pre-encoded HTTP chunks, optionally cut short or paced."""

    head_frames: list[bytes]
    """Frames before the content deltas (the role chunk), already chunk-encoded."""
    delta_frames: list[bytes]
    tail_frames: list[bytes]
    """finish chunk, usage chunk, ``[DONE]``, and the terminating zero-length chunk."""
    cut_after: int | None = None
    delay_s: float = 0.0
    hold_after: int | None = None
    hold: threading.Event | None = None
    """After ``hold_after`` deltas the stream waits until ``hold`` is set (a test acts meanwhile)."""
    joined: bytes | None = None
    """Everything at once, for the fast path (no cut, no delay)."""


class FakeReply:
    """One scripted answer of the fake server. Build with the class methods; replies are reusable.

    A ``text`` or ``tool_calls`` reply given to a streaming request is served as a stream (the text cut
    into words), and a ``stream`` reply given to a non-streaming request as one JSON completion, so a
    handler need not care which kind of call it answers. Encoded streams are cached per reply, which
    keeps the serving path cheap for benchmarks.
    """

    __slots__ = (
        "_cache",
        "body",
        "content",
        "cut_after",
        "delay_s",
        "deltas",
        "finish_reason",
        "headers",
        "hold",
        "hold_after",
        "kind",
        "raw",
        "reasoning_content",
        "seconds",
        "status",
        "then",
        "tool_call_list",
        "until",
        "usage",
    )

    def __init__(self, kind: ReplyKind) -> None:
        self.kind: ReplyKind = kind
        self.content: str | None = None
        self.reasoning_content: str | None = None
        self.usage: UsageSpec = None
        self.finish_reason: str | None = None
        self.tool_call_list: list[tuple[str, str]] = []
        self.deltas: list[str] = []
        self.cut_after: int | None = None
        self.delay_s = 0.0
        self.status = 200
        self.body: Any = None
        self.headers: dict[str, str] = {}
        self.seconds = 0.0
        self.then: FakeReply | None = None
        self.until: threading.Event | None = None
        self.raw = b""
        self.hold_after: int | None = None
        self.hold: threading.Event | None = None
        self._cache: dict[tuple[str, bool], StreamPlan] = {}

    def __repr__(self) -> str:
        return f"FakeReply.{self.kind}(...)"

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def text(
        cls,
        content: str,
        reasoning_content: str | None = None,
        usage: UsageSpec = None,
        *,
        finish_reason: str = "stop",
    ) -> FakeReply:
        """A plain assistant message; ``reasoning_content`` is the DeepSeek-style extra field."""
        reply = cls("text")
        reply.content = content
        reply.reasoning_content = reasoning_content
        reply.usage = usage
        reply.finish_reason = finish_reason
        return reply

    @classmethod
    def tool_calls(
        cls,
        calls: Sequence[tuple[str, Mapping[str, Any] | str]],
        *,
        content: str | None = None,
        usage: UsageSpec = None,
    ) -> FakeReply:
        """An assistant message asking for tools: ``[(name, args dict or raw argument string), ...]``."""
        reply = cls("tool_calls")
        reply.content = content
        reply.usage = usage
        reply.finish_reason = "tool_calls"
        reply.tool_call_list = [
            (name, args if isinstance(args, str) else orjson.dumps(dict(args)).decode())
            for name, args in calls
        ]
        return reply

    @classmethod
    def stream(
        cls,
        deltas: Sequence[str],
        cut_after: int | None = None,
        delay_s: float = 0.0,
        *,
        usage: UsageSpec = None,
        finish_reason: str = "stop",
        hold_after: int | None = None,
        hold: threading.Event | None = None,
    ) -> FakeReply:
        """SSE chunks, one per delta; ``cut_after=n`` drops the connection after ``n`` deltas;
        ``hold_after=n`` waits after ``n`` deltas until ``hold`` is set."""
        reply = cls("stream")
        reply.deltas = list(deltas)
        reply.cut_after = cut_after
        reply.delay_s = delay_s
        reply.hold_after = hold_after
        reply.hold = hold
        reply.usage = usage
        reply.finish_reason = finish_reason
        return reply

    @classmethod
    def error(cls, status: int, body: Any = None, headers: Mapping[str, str] | None = None) -> FakeReply:
        """An HTTP error; ``body`` defaults to an OpenAI-style error object (a str or bytes is sent as is)."""
        reply = cls("error")
        reply.status = status
        reply.body = body
        reply.headers = dict(headers or {})
        return reply

    @classmethod
    def hang(cls, seconds: float, then: FakeReply | None = None) -> FakeReply:
        """Say nothing for ``seconds``; then answer ``then``, or close the connection without a word."""
        reply = cls("hang")
        reply.seconds = seconds
        reply.then = then
        return reply

    @classmethod
    def blocked(cls, until: threading.Event, then: FakeReply, timeout_s: float = 30.0) -> FakeReply:
        """Hold the request until ``until`` is set (by the test), then answer ``then``.

        For tests that must act while an LLM call is in flight, without sleeping.
        """
        reply = cls("blocked")
        reply.until = until
        reply.then = then
        reply.seconds = timeout_s
        return reply

    @classmethod
    def malformed(
        cls,
        raw_bytes: bytes,
        *,
        status: int = 200,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> FakeReply:
        """A body that is not what a client expects (by default labelled as JSON), or any body
        with any ``headers`` (a stream sent whole, with a content coding)."""
        reply = cls("malformed")
        reply.raw = raw_bytes
        reply.status = status
        reply.headers = {"content-type": content_type, **(headers or {})}
        return reply

    @classmethod
    def no_choices(cls) -> FakeReply:
        """A well-formed completion object whose ``choices`` list is empty."""
        return cls("no_choices")

    # -- rendering ----------------------------------------------------------------------------

    def render(self, request: Mapping[str, Any]) -> HttpResponse | StreamPlan:
        model = str(request.get("model") or "fake-model")
        streaming = bool(request.get("stream"))
        if self.kind == "error":
            return self._render_error()
        if self.kind == "malformed":
            ctype = self.headers.get("content-type", "application/json")
            extra = {k: v for k, v in self.headers.items() if k != "content-type"}
            return HttpResponse(self.status, self.raw, content_type=ctype, headers=extra)
        if self.kind == "no_choices":
            return HttpResponse(200, orjson.dumps(self._completion(model, request, choices=[])))
        if streaming and self.kind in ("text", "tool_calls", "stream"):
            options = request.get("stream_options")
            include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
            key = (model, include_usage)
            plan = self._cache.get(key)
            if plan is None:
                plan = self._stream_plan(model, include_usage, request)
                self._cache[key] = plan
            return plan
        return HttpResponse(200, orjson.dumps(self._completion(model, request)))

    def _render_error(self) -> HttpResponse:
        body = self.body
        if body is None:
            body = {
                "error": {
                    "message": f"fake error {self.status}",
                    "type": "server_error" if self.status >= 500 else "invalid_request_error",
                    "code": str(self.status),
                }
            }
        if isinstance(body, str):
            body = body.encode()
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "content-type"}
        ctype = self.headers.get("content-type", "application/json")
        return HttpResponse(self.status, raw, content_type=ctype, headers=headers)

    def _full_content(self) -> str | None:
        if self.kind == "stream":
            return "".join(self.deltas)
        return self.content

    def _tool_calls_json(self) -> list[dict[str, Any]]:
        return [
            {"id": f"call_{i}_{name}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(self.tool_call_list)
        ]

    def _completion(
        self, model: str, request: Mapping[str, Any], *, choices: list[Any] | None = None
    ) -> dict[str, Any]:
        content = self._full_content()
        if choices is None:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.tool_call_list:
                message["tool_calls"] = self._tool_calls_json()
            if self.reasoning_content is not None:
                message["reasoning_content"] = self.reasoning_content
            choices = [
                {"index": 0, "message": message, "finish_reason": self.finish_reason, "logprobs": None}
            ]
        completion_text = (content or "") + "".join(args for _, args in self.tool_call_list)
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": _CREATED,
            "model": model,
            "choices": choices,
            "usage": _usage_dict(self.usage, _messages_text(request), completion_text),
        }

    def _stream_plan(self, model: str, include_usage: bool, request: Mapping[str, Any]) -> StreamPlan:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            obj: dict[str, Any] = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": _CREATED,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            if include_usage:
                obj["usage"] = None
            return _chunked(_sse(obj))

        if self.kind == "stream":
            deltas = self.deltas
        else:
            deltas = split_words(self.content or "")
        head = [chunk({"role": "assistant", "content": ""})]
        body = [chunk({"content": d}) for d in deltas]
        if self.tool_call_list:
            calls = [dict(call, index=i) for i, call in enumerate(self._tool_calls_json())]
            body.append(chunk({"tool_calls": calls}))
        tail = [chunk({}, self.finish_reason or "stop")]
        if include_usage:
            completion_text = "".join(deltas) + "".join(args for _, args in self.tool_call_list)
            usage_obj = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": _CREATED,
                "model": model,
                "choices": [],
                "usage": _usage_dict(self.usage, _messages_text(request), completion_text),
            }
            tail.append(_chunked(_sse(usage_obj)))
        tail.append(_chunked(_SSE_DONE))
        tail.append(b"0\r\n\r\n")
        plan = StreamPlan(
            head,
            body,
            tail,
            cut_after=self.cut_after,
            delay_s=self.delay_s,
            hold_after=self.hold_after,
            hold=self.hold,
        )
        if plan.cut_after is None and plan.delay_s <= 0 and plan.hold is None:
            plan.joined = b"".join(head + body + tail)
        return plan
