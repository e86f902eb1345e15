"""The load generator of ``bench/capacity_bench.py knee``: N users, each keeping one run streaming.

It has to stay cheap: at 1,000 runs of 50 tokens/s it reads 50,000 events a second on the same 2
cores as the worker it measures. So a stream is an ``asyncio.Protocol`` (no ``StreamReader``, no
task per read): ``data_received`` decodes the chunked body and the SSE frames of every read at once,
reads the clock once per read, and keeps per token only its latency (received - the fake LLM's
send stamp, µs; ``bench/fakellm.py --timed``) when it falls in the level's timed window.

``Level`` runs one level: users arrive spread over ``ramp_s`` (so their token phases spread as real
users' do), each starts its next run when one ends, until ``stop_at``; the window
``[window_start, stop_at]`` is what the latency figures cover; runs in flight at ``stop_at`` are
read to their end and checked. Two subjects:

* AgentStream: ``POST /api/conversations`` then ``POST .../runs`` on a keep-alive connection (the
  JSON client of ``bench/wire.py``), then ``GET .../stream`` on a connection of its own, to ``done``;
* the LangGraph API server: ``POST /threads``, then ``POST /threads/{id}/runs/stream``
  (``stream_mode=messages-tuple``) read to its end, then ``GET /threads/{id}/state`` for the answer
  the server kept (what AgentStream's ``done.answer`` is).

A run is good when it ended (``done`` with status ``completed``; for LangGraph the stream ended
with no ``error`` event), its deltas concatenate to the final answer, and that answer is the
fake's: exactly ``tokens`` stamped tokens (``"w t<µs>"``, space-separated), stamps increasing.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from bench.measure import QUESTION, percentile
from bench.wire import Connection

HOST = "127.0.0.1"
_STAMP = re.compile(rb"w t(\d+)")
AGENT = {"tools": ["calculator"], "completion_check": False}


def fake_answer_ok(answer: str, tokens: int) -> bool:
    """``answer`` is what ``bench/fakellm.py --timed`` streams: ``tokens`` stamped tokens, in order."""
    parts = answer.split(" ")
    if len(parts) != 2 * tokens:
        return False
    stamps = [int(p[1:]) for p in parts[1::2] if p[:1] == "t" and p[1:].isdigit()]
    return len(stamps) == tokens and parts[::2] == ["w"] * tokens and stamps == sorted(stamps)


class SseProtocol(asyncio.Protocol):
    """One HTTP request whose response is an event stream; ``on_event(received_us, event, id,
    data)`` per event (bytes). ``finished`` resolves when the response ends or the connection goes."""

    def __init__(self, request: bytes, on_event: Callable[[int, bytes, bytes, bytes], None]) -> None:
        self.request = request
        self.on_event = on_event
        self.status = 0
        self.error = ""
        self.connected_us = 0
        self.bytes_in = 0
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buf = bytearray()
        self._sse = b""
        self._head = True
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            if self.status == 200 and not self.error:
                self.error = "connection closed before the end of the stream"
            self.finished.set_result(None)

    def _end(self, error: str = "") -> None:
        self.error = self.error or error
        if not self.finished.done():
            self.finished.set_result(None)
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.time_ns() // 1000
        self.bytes_in += len(data)
        buf = self._buf
        buf += data
        if self._head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            del buf[: end + 4]
            self._head = False
            self.status = int(head.split(b" ", 2)[1])
            self.connected_us = now
            if self.status != 200:
                self._end(f"status {self.status}")
                return
            if b"transfer-encoding: chunked" not in head:
                self._end("not a chunked event stream")
                return
        pos, pieces = 0, []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            end = eol + 2 + size + 2
            if size == 0:
                pos = len(buf)
                self._end()
                break
            if len(buf) < end:
                break
            pieces.append(buf[eol + 2 : eol + 2 + size])
            pos = end
        del buf[:pos]
        if not pieces:
            return
        text = self._sse + b"".join(pieces)
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n")
        frames = text.split(b"\n\n")
        self._sse = frames.pop()
        for frame in frames:
            event = ident = data = b""
            for line in frame.split(b"\n"):
                if line[:7] == b"event: ":
                    event = line[7:]
                elif line[:6] == b"data: ":
                    data = line[6:]
                elif line[:4] == b"id: ":
                    ident = line[4:]
            if event:
                self.on_event(now, event, ident, data)


def request_bytes(
    method: str, path: str, port: int, body: Any = None, accept: str = "text/event-stream"
) -> bytes:
    payload = orjson.dumps(body) if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nhost: {HOST}:{port}\r\naccept: {accept}\r\n"
    if body is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n"
    return (head + "\r\n").encode() + payload


class Level:
    """One load level: its users' runs, the window's token latencies and every run's check."""

    def __init__(
        self, users: int, tokens: int, token_rate: float, ramp_s: float, window_s: float, settle_s: float
    ) -> None:
        self.users = users
        self.tokens = tokens
        self.token_rate = token_rate
        self.t0 = time.time()
        self.ramp_s = ramp_s
        self.window_start_us = int((self.t0 + ramp_s + settle_s) * 1e6)
        self.stop_at = self.t0 + ramp_s + settle_s + window_s
        self.stop_us = int(self.stop_at * 1e6)
        self.latencies: list[int] = []
        self.to_publish: list[int] = []
        """AgentStream: µs from the fake's send to the publish time in the event's id (ms resolution)."""
        self.from_publish: list[int] = []
        """AgentStream: µs from that publish time to the client's receipt."""
        self.runs_started = 0
        self.runs_good = 0
        self.problems: dict[str, int] = {}
        self.examples: list[str] = []
        self.replayed = 0
        self.tokens_all = 0
        """Every token received live, in the window or not (for a profile of the whole level)."""
        self.events = 0
        self.first_token_ms: list[float] = []
        """Per run started in the window: from sending its start (POST) to its first answer token."""

    def problem(self, kind: str, detail: str = "") -> None:
        self.problems[kind] = self.problems.get(kind, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{kind}: {detail}"[:300])

    def start_delay(self, i: int) -> float:
        return max(0.0, self.t0 + i * self.ramp_s / self.users - time.time())

    def stamps(self, received: int, connected: int, text: bytes, published_us: int = 0) -> None:
        """Every stamp in an answer delta: a latency sample when it is inside the window;
        ``published_us`` (the event id's time, AgentStream) splits it in two."""
        lo, hi = self.window_start_us, self.stop_us
        for m in _STAMP.finditer(text):
            sent = int(m.group(1))
            if sent < connected:
                self.replayed += 1
                continue
            self.tokens_all += 1
            if lo <= received <= hi:
                self.latencies.append(received - sent)
                if published_us:
                    self.to_publish.append(published_us - sent)
                    self.from_publish.append(received - published_us)

    def first_token(self, posted_us: int, received_us: int) -> None:
        if self.window_start_us <= posted_us <= self.stop_us:
            self.first_token_ms.append((received_us - posted_us) / 1000)

    def summary(self) -> dict[str, Any]:
        ms = [x / 1000 for x in self.latencies]
        window = (self.stop_us - self.window_start_us) / 1e6
        return {
            "users": self.users,
            "runs_started": self.runs_started,
            "runs_good": self.runs_good,
            "problems": self.problems,
            "problem_examples": self.examples,
            "tokens_timed": len(ms),
            "tokens_per_s": len(ms) / window,
            "tokens_per_s_offered": self.users * self.token_rate,
            "streaming_runs_mean": len(ms) / window / self.token_rate,
            "start_to_first_token_ms_p50": percentile(self.first_token_ms, 0.5),
            "start_to_first_token_ms_p99": percentile(self.first_token_ms, 0.99),
            "tokens_replayed": self.replayed,
            "tokens_all": self.tokens_all,
            "p50_ms": percentile(ms, 0.5),
            "p95_ms": percentile(ms, 0.95),
            "p99_ms": percentile(ms, 0.99),
            "max_ms": max(ms) if ms else float("nan"),
            "llm_to_publish_ms_p50": percentile([x / 1000 for x in self.to_publish], 0.5),
            "llm_to_publish_ms_p99": percentile([x / 1000 for x in self.to_publish], 0.99),
            "publish_to_client_ms_p50": percentile([x / 1000 for x in self.from_publish], 0.5),
            "publish_to_client_ms_p99": percentile([x / 1000 for x in self.from_publish], 0.99),
        }


async def _stream(port: int, proto: SseProtocol) -> None:
    await asyncio.get_running_loop().create_connection(lambda: proto, HOST, port)
    await proto.finished


async def agentstream_run(level: Level, conn: Connection, port: int) -> None:
    """One run through AgentStream's API, read to ``done`` and checked."""
    status, conv = await conn.request("POST", "/api/conversations", {"agent": AGENT})
    if status != 201:
        level.problem("create_conversation", f"{status} {conv}")
        return
    posted = time.time_ns() // 1000
    status, run = await conn.request("POST", f"/api/conversations/{conv['id']}/runs", {"message": QUESTION})
    if status != 202:
        level.problem("start_run", f"{status} {run}")
        return
    level.runs_started += 1
    parts: list[str] = []
    done: dict[str, Any] = {}

    def on_event(received: int, event: bytes, ident: bytes, data: bytes) -> None:
        level.events += 1
        if event == b"answer":
            payload = orjson.loads(data)
            if payload.get("status") == "delta":
                content = payload["content"]
                if not parts:
                    level.first_token(posted, received)
                parts.append(content)
                published = int(ident.split(b"-", 1)[0]) * 1000 if ident else 0
                level.stamps(received, proto.connected_us, content.encode(), published)
        elif event == b"done":
            done.update(orjson.loads(data))

    proto = SseProtocol(request_bytes("GET", f"/api/conversations/{conv['id']}/stream", port), on_event)
    await _stream(port, proto)
    answer = "".join(parts)
    if proto.error:
        level.problem("stream", proto.error)
    elif done.get("status") != "completed":
        level.problem("not_completed", str(done)[:200])
    elif done.get("answer") != answer:
        level.problem("done_answer_differs_from_deltas", run["run_id"])
    elif not fake_answer_ok(answer, level.tokens):
        level.problem("answer_differs_from_fake", answer[:120])
    else:
        level.runs_good += 1


async def langgraph_run(level: Level, conn: Connection, port: int) -> None:
    """One run through the LangGraph API server's HTTP streaming API, read to its end and checked."""
    status, thread = await conn.request("POST", "/threads", {})
    if status != 200:
        level.problem("create_thread", f"{status} {thread}")
        return
    body = {
        "assistant_id": "agent",
        "input": {"messages": [{"role": "user", "content": QUESTION}]},
        "stream_mode": ["messages-tuple"],
    }
    level.runs_started += 1
    parts: list[str] = []
    errors: list[bytes] = []

    def on_event(received: int, event: bytes, ident: bytes, data: bytes) -> None:
        level.events += 1
        if event == b"messages":
            message, meta = orjson.loads(data)
            if message.get("type") == "AIMessageChunk" and meta.get("langgraph_node") == "agent":
                content = message.get("content")
                if isinstance(content, str) and content:
                    if not parts:
                        level.first_token(posted, received)
                    parts.append(content)
                    level.stamps(received, proto.connected_us, content.encode())
        elif event == b"error":
            errors.append(data)

    proto = SseProtocol(
        request_bytes("POST", f"/threads/{thread['thread_id']}/runs/stream", port, body), on_event
    )
    posted = time.time_ns() // 1000
    await _stream(port, proto)
    answer = "".join(parts)
    if proto.error or errors:
        level.problem("stream", proto.error or errors[0][:200].decode(errors="replace"))
        return
    status, state = await conn.request("GET", f"/threads/{thread['thread_id']}/state")
    final = ((state or {}).get("values") or {}).get("messages") or [{}]
    if status != 200:
        level.problem("state", f"{status}")
    elif final[-1].get("content") != answer:
        level.problem("final_answer_differs_from_deltas", thread["thread_id"])
    elif not fake_answer_ok(answer, level.tokens):
        level.problem("answer_differs_from_fake", answer[:120])
    else:
        level.runs_good += 1


async def run_level(
    level: Level,
    ports: list[int],
    one_run: Callable[[Level, Connection, int], Any],
    hard_deadline: float,
) -> None:
    """Every user of ``level`` (user i on ``ports[i % len(ports)]``, round robin), bounded in time:
    a user starts runs until ``level.stop_at``; whatever still runs at ``hard_deadline`` is cancelled
    and counted as ``unfinished``."""

    async def user(i: int) -> None:
        port = ports[i % len(ports)]
        await asyncio.sleep(level.start_delay(i))
        conn = Connection(HOST, port)
        try:
            while time.time() < level.stop_at:
                try:
                    await one_run(level, conn, port)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    level.problem("connection", repr(exc))
                    await conn.close()
                    await asyncio.sleep(0.1)
        finally:
            await conn.close()

    tasks = [asyncio.create_task(user(i)) for i in range(level.users)]
    _, pending = await asyncio.wait(tasks, timeout=max(1.0, hard_deadline - time.time()))
    for task in pending:
        task.cancel()
        level.problem("unfinished", "a run still streaming at the level's time limit")
    await asyncio.gather(*tasks, return_exceptions=True)
