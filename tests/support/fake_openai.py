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
  requests. ``tests.support.fake_agents`` has handlers that play a well-behaved agent model.

Run standalone for subprocess tests and benchmarks::

    python -m tests.support.fake_openai --port 0 --mode echo --tokens 200

prints ``http://127.0.0.1:<port>/v1`` on its first line and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson

from tests.support.fake_replies import (
    _CREATED,
    _REASONS,
    FakeReply,
    Handler,
    HttpResponse,
    StreamPlan,
)

_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    query: str = ""


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
        path, _, query = rest.rsplit(" ", 1)[0].partition("?")
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
        # Any path ending in chat/completions: Azure's deployment URLs too (with their query).
        if method != "POST" or not path.partition("?")[0].rstrip("/").endswith("/chat/completions"):
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

        self._record(method, path, headers, body, query)
        reply = self._choose(body)
        if reply is None:
            err = {"error": {"message": "unscripted request: the fake server has no reply for it"}}
            await self._write(writer, HttpResponse(500, orjson.dumps(err)), keep_alive)
            return keep_alive
        return await self._answer(writer, reply, body, keep_alive)

    def _record(
        self, method: str, path: str, headers: dict[str, str], body: dict[str, Any] | None, query: str = ""
    ) -> None:
        with self._lock:
            self._received.append(ReceivedRequest(method, path, headers, body, query))

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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible server for tests and benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--mode", choices=["echo", "tool", "error", "ratelimit"], default="echo")
    parser.add_argument("--tokens", type=int, default=8, help="tokens in each streamed answer")
    parser.add_argument("--delay-s", type=float, default=0.0, help="pause between streamed tokens")
    args = parser.parse_args(argv)
    from tests.support.fake_agents import MODES  # the agents module builds on this one

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
