"""A fake OpenAI-compatible HTTP server for tests and benchmarks.

``FakeOpenAIServer`` is a real HTTP/1.1 server on 127.0.0.1 (a free port unless one is given) that runs
in a background thread with its own event loop, so sync tests, async tests and subprocesses can all talk
to it over a socket. It serves ``POST /v1/chat/completions`` (JSON, or SSE chunks in the OpenAI wire
format with a final usage chunk when ``stream_options.include_usage`` is set) and ``GET /v1/models``, and
records every request body in ``.requests``.

Two ways to drive it:

* a strict script, ``server.script(FakeReply.text("hi"), FakeReply.error(429, headers=...))``: each
  request takes the next reply; a request with nothing scripted (and no handler) gets a 500 whose body
  says "unscripted request" and lands in ``.unexpected``; ``assert_done()`` fails if scripted replies
  remain or unexpected requests came;
* a handler, ``server.set_handler(fn)`` with ``fn(request_body) -> FakeReply``, for tests that run many
  requests. ``EchoAgentBehaviour`` and ``ToolAgentBehaviour`` are handlers that play a well-behaved agent
  model (final answers in native and JSON mode, a fixed streamed answer, optionally one tool call first).

Run standalone for subprocess tests and benchmarks::

    python -m tests.support.fake_openai --port 0 --mode echo --tokens 200

prints ``http://127.0.0.1:<port>/v1`` on its first line and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
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
_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024


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
        cls, raw_bytes: bytes, *, status: int = 200, content_type: str = "application/json"
    ) -> FakeReply:
        """A body that is not what a client expects (by default labelled as JSON)."""
        reply = cls("malformed")
        reply.raw = raw_bytes
        reply.status = status
        reply.headers = {"content-type": content_type}
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
            return HttpResponse(self.status, self.raw, content_type=ctype)
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


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


class _ConnectionDropped(Exception):
    """The reply says to close the connection without answering."""


class FakeOpenAIServer:
    """See the module docstring. Use as a context manager or call ``start()``/``stop()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, model: str = "fake-model") -> None:
        self.host = host
        self._requested_port = port
        self.model = model
        self.port: int | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._script: list[FakeReply] = []
        self._handler: Handler | None = None
        self._requests: list[dict[str, Any]] = []
        self._received: list[ReceivedRequest] = []
        self._unexpected: list[dict[str, Any]] = []
        self._handler_errors: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("FakeOpenAIServer is not started")
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> FakeOpenAIServer:
        if self._thread is not None:
            raise RuntimeError("FakeOpenAIServer already started")
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._loop = loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-openai", daemon=True)
        self._thread.start()
        ready.wait()
        future = asyncio.run_coroutine_threadsafe(self._open(), loop)
        future.result(timeout=10)
        return self

    async def _open(self) -> None:
        self._server = await asyncio.start_server(self._serve_connection, self.host, self._requested_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._loop = None
        self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def serve_forever(self, ready: asyncio.Event | None = None) -> None:
        """Serve on the current event loop until cancelled (the standalone process uses this)."""
        self._loop = asyncio.get_running_loop()
        await self._open()
        if ready is not None:
            ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            await self._close()

    # -- driving ------------------------------------------------------------------------------

    def script(self, *replies: FakeReply) -> FakeOpenAIServer:
        """Queue replies; each request takes the next one, in order."""
        with self._lock:
            self._script.extend(replies)
        return self

    def set_handler(self, handler: Handler | None) -> FakeOpenAIServer:
        """Answer every request the script does not cover with ``handler(request_body)``."""
        with self._lock:
            self._handler = handler
        return self

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Bodies of every chat completion request so far (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def received(self) -> list[ReceivedRequest]:
        """Every HTTP request so far with method, path and headers (a copy)."""
        with self._lock:
            return list(self._received)

    @property
    def unexpected(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._unexpected)

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self._script)

    def assert_done(self) -> None:
        """Fail if scripted replies were never requested, requests came unscripted, or a handler raised."""
        with self._lock:
            problems: list[str] = []
            if self._script:
                problems.append(f"{len(self._script)} scripted replies never requested: {self._script}")
            if self._unexpected:
                problems.append(f"{len(self._unexpected)} unscripted requests came")
            problems.extend(f"handler raised: {err}" for err in self._handler_errors)
        if problems:
            raise AssertionError("FakeOpenAIServer: " + "; ".join(problems))

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Block until ``count`` chat requests arrived (for sync tests); raise on timeout."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._requests) >= count, timeout=timeout):
                raise AssertionError(
                    f"expected {count} requests within {timeout}s, got {len(self._requests)}"
                )
            return list(self._requests)

    async def wait_for_requests_async(self, count: int, within_s: float = 5.0) -> list[dict[str, Any]]:
        """Poll (with a deadline) until ``count`` chat requests arrived, without blocking the test's loop."""
        deadline = time.monotonic() + within_s
        while True:
            with self._lock:
                if len(self._requests) >= count:
                    return list(self._requests)
                got = len(self._requests)
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} requests within {within_s}s, got {got}")
            await asyncio.sleep(0.005)

    def _choose(self, body: dict[str, Any]) -> FakeReply | None:
        with self._arrived:
            self._requests.append(body)
            self._arrived.notify_all()
            if self._script:
                return self._script.pop(0)
            handler = self._handler
            if handler is None:
                self._unexpected.append(body)
                return None
        try:
            return handler(body)
        except Exception as exc:
            with self._lock:
                self._handler_errors.append(f"{type(exc).__name__}: {exc}")
            return FakeReply.error(
                500, {"error": {"message": f"fake handler raised {type(exc).__name__}: {exc}"}}
            )

    # -- HTTP ---------------------------------------------------------------------------------

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _ConnectionDropped):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection should close."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        if len(head) > _MAX_HEADER_BYTES:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.rsplit(" ", 1)[0].split("?", 1)[0]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        raw = await self._read_body(reader, headers)
        keep_alive = headers.get("connection", "").lower() != "close"

        if method == "GET" and path.rstrip("/") in ("/v1/models", "/models"):
            self._record(method, path, headers, None)
            models = {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": _CREATED, "owned_by": "fake"}],
            }
            await self._write(writer, HttpResponse(200, orjson.dumps(models)), keep_alive)
            return keep_alive
        if method != "POST" or path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._record(method, path, headers, None)
            err = {"error": {"message": f"no route {method} {path}", "type": "not_found"}}
            await self._write(writer, HttpResponse(404, orjson.dumps(err)), keep_alive)
            return keep_alive
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            self._record(method, path, headers, None)
            err = {"error": {"message": "request body is not a JSON object", "type": "invalid_request_error"}}
            await self._write(writer, HttpResponse(400, orjson.dumps(err)), keep_alive)
            return keep_alive

        self._record(method, path, headers, body)
        reply = self._choose(body)
        if reply is None:
            err = {"error": {"message": "unscripted request: the fake server has no reply for it"}}
            await self._write(writer, HttpResponse(500, orjson.dumps(err)), keep_alive)
            return keep_alive
        return await self._answer(writer, reply, body, keep_alive)

    def _record(self, method: str, path: str, headers: dict[str, str], body: dict[str, Any] | None) -> None:
        with self._lock:
            self._received.append(ReceivedRequest(method, path, headers, body))

    @staticmethod
    async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    return b"".join(parts)
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
        length = int(headers.get("content-length", "0") or 0)
        if length > _MAX_BODY_BYTES:
            raise _ConnectionDropped
        return await reader.readexactly(length) if length else b""

    async def _answer(
        self, writer: asyncio.StreamWriter, reply: FakeReply, body: dict[str, Any], keep_alive: bool
    ) -> bool:
        if reply.kind == "hang":
            await asyncio.sleep(reply.seconds)
            if reply.then is None:
                raise _ConnectionDropped
            return await self._answer(writer, reply.then, body, keep_alive)
        if reply.kind == "blocked":
            assert reply.until is not None and reply.then is not None
            deadline = time.monotonic() + reply.seconds
            while not reply.until.is_set():
                if time.monotonic() > deadline:
                    raise _ConnectionDropped
                await asyncio.sleep(0.005)
            return await self._answer(writer, reply.then, body, keep_alive)
        rendered = reply.render(body)
        if isinstance(rendered, HttpResponse):
            await self._write(writer, rendered, keep_alive)
            return keep_alive
        await self._write_stream(writer, rendered)
        return rendered.cut_after is None

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, response: HttpResponse, keep_alive: bool) -> None:
        reason = _REASONS.get(response.status, "Status")
        lines = [
            f"HTTP/1.1 {response.status} {reason}",
            f"content-type: {response.content_type}",
            f"content-length: {len(response.body)}",
            f"connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        lines.extend(f"{k}: {v}" for k, v in response.headers.items())
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body)
        await writer.drain()

    @staticmethod
    async def _write_stream(writer: asyncio.StreamWriter, plan: StreamPlan) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n"
        )
        if plan.joined is not None:
            writer.write(plan.joined)
            await writer.drain()
            return
        for frame in plan.head_frames:
            writer.write(frame)
        await writer.drain()
        for i, frame in enumerate(plan.delta_frames):
            if plan.cut_after is not None and i >= plan.cut_after:
                break
            if plan.hold is not None and i == plan.hold_after:
                await asyncio.to_thread(plan.hold.wait, 60)
            if plan.delay_s > 0:
                await asyncio.sleep(plan.delay_s)
            writer.write(frame)
            await writer.drain()
        if plan.cut_after is not None:
            # The body is chunked and unfinished: closing now is what a dropped upstream looks like.
            raise _ConnectionDropped
        for frame in plan.tail_frames:
            writer.write(frame)
        await writer.drain()


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible server for tests and benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--mode", choices=sorted(MODES), default="echo")
    parser.add_argument("--tokens", type=int, default=8, help="tokens in each streamed answer")
    parser.add_argument("--delay-s", type=float, default=0.0, help="pause between streamed tokens")
    args = parser.parse_args(argv)

    server = FakeOpenAIServer(args.host, args.port)
    server.set_handler(MODES[args.mode](args))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        serving = asyncio.ensure_future(server.serve_forever(ready))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, serving.cancel)
        await asyncio.wait(
            [serving, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if ready.is_set():
            print(server.base_url, flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1:])
