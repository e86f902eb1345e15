"""The client side of ``bench/faces_bench.py``: one run of the benchmark job through the own API, the
AI SDK face or the AG-UI face, its response read off the socket and counted the same way for each,
and the run checked through the face's own stream.

* ``exchange``: one request on a connection of its own, the response read to its end: the SSE
  frames, and the bytes of the status line and headers, the chunked framing and the body apart;
* ``run_own`` / ``run_aisdk`` / ``run_agui`` (``RUNNERS``): one run in a ``Thread`` (a new one, or
  the next run of one, the client sending back the history it holds, as each protocol's client
  does); what the stream said (the answer's deltas, the tool results, how it ended);
* ``check``: the tool results and exactly the fake LLM's answer.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.measure import QUESTION
from bench.service_stack import AGENT, HOST, new_conversation, start_run
from bench.wire import Connection, _head, _read_head

ROUTES = {"ai-sdk": "/api/ai-sdk/chat", "ag-ui": "/api/ag-ui"}


class NotAvailableError(Exception):
    """The service has no route for this face."""


class WrongRunError(Exception):
    pass


@dataclass
class Reply:
    """One response as received: its frames (``event``, ``data``) and its bytes."""

    status: int = 0
    out_bytes: int = 0
    """The request: head and body."""
    head_bytes: int = 0
    framing_bytes: int = 0
    """Chunked transfer's size lines and CRLFs (the terminating chunk too)."""
    body_bytes: int = 0
    pings: int = 0
    frames: list[tuple[str, str]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    """Each frame's bytes in the body (its blank line too), in the order of ``frames``."""
    text: bytes = b""
    """The body of a response that is not an event stream."""

    @property
    def wire_bytes(self) -> int:
        return self.head_bytes + self.framing_bytes + self.body_bytes


def _frames(text: str, reply: Reply) -> None:
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        event, data = "", []
        for line in frame.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[6:] if line.startswith("data: ") else line[5:])
            elif line.startswith(":"):
                reply.pings += 1
        if data:
            reply.frames.append((event, "\n".join(data)))
            reply.sizes.append(len(frame.encode()) + 2)


async def exchange(port: int, method: str, path: str, payload: Any = None) -> Reply:
    """One request on a connection of its own, its response read to the end and counted.

    The same for every subject (the own stream's GET and the faces' POSTs), so that their bytes are
    counted alike; the SSE frames are parsed after the last byte (the client's time is not measured).
    """
    reply = Reply()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        body = orjson.dumps(payload) if payload is not None else None
        request = _head(method, path, HOST, port, body, "accept: text/event-stream")
        writer.write(request)
        reply.out_bytes = len(request)
        reply.status, headers, reply.head_bytes = await _read_head(reader)
        parts: list[bytes] = []
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                chunk = await reader.readexactly(size + 2)
                reply.framing_bytes += len(size_line) + 2
                reply.body_bytes += size
                if size == 0:
                    break
                parts.append(chunk[:-2])
        else:
            length = int(headers.get("content-length", "0"))
            parts.append(await reader.readexactly(length) if length else b"")
            reply.body_bytes += length
        raw = b"".join(parts)
        if headers.get("content-type", "").startswith("text/event-stream"):
            _frames(raw.decode(), reply)
        else:
            reply.text = raw
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    return reply


@dataclass
class Thread:
    """A subject's conversation (own), chat (AI SDK) or thread (AG-UI), and the history its client
    holds and sends back (the faces' clients send the whole of it with every request)."""

    id: str = ""
    runs: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    snapshot: bool = False
    """AG-UI: whether the last response carried a ``MESSAGES_SNAPSHOT``."""


@dataclass
class Run:
    answer: str
    tool_results: int
    ended: str
    """How the stream ended: ``ok``, or what was wrong with its end."""
    stream: Reply
    request_bytes: int
    delta_overhead: list[int] = field(default_factory=list)
    """Per answer-delta frame: its bytes besides the text itself (what each streamed token would
    cost if the model's tokens came one per frame)."""


def overhead(size: int, text: str) -> int:
    """A delta frame's bytes less its text's (as JSON escapes it, without the quotes)."""
    return size - (len(orjson.dumps(text)) - 2)


def _refused(face: str, reply: Reply) -> None:
    if reply.status == 404:
        raise NotAvailableError(f"POST {ROUTES[face]} answered 404 (the face is not in this service)")
    if reply.status != 200:
        raise WrongRunError(f"{face}: POST answered {reply.status}: {reply.text[:300]!r}")


async def run_own(port: int, conn: Connection, thread: Thread) -> Run:
    before = conn.bytes_in + conn.bytes_out
    thread.id = thread.id or await new_conversation(conn)
    thread.runs += 1
    await start_run(conn, thread.id)
    reply = await exchange(port, "GET", f"/api/conversations/{thread.id}/stream")
    if reply.status != 200:
        raise WrongRunError(f"own: stream answered {reply.status}")
    parts: list[str] = []
    tools = 0
    done: dict[str, Any] = {}
    deltas: list[int] = []
    for (event, data), size in zip(reply.frames, reply.sizes, strict=True):
        if event == "answer":
            answer = orjson.loads(data)
            if answer.get("status") == "delta":
                parts.append(answer.get("content") or "")
                deltas.append(overhead(size, parts[-1]))
        elif event == "step":
            step = orjson.loads(data)
            if step.get("type") == "iteration" and step.get("status") == "done" and step.get("error") is None:
                tools += 1
        elif event == "done":
            done = orjson.loads(data)
    answer_text = "".join(parts)
    last = reply.frames[-1][0] if reply.frames else ""
    ended = "ok"
    if last != "done" or done.get("status") != "completed" or done.get("answer") != answer_text:
        ended = f"last event {last!r}, done {str(done)[:200]}"
    requests = conn.bytes_in + conn.bytes_out - before + reply.out_bytes
    return Run(answer_text, tools, ended, reply, requests, deltas)


async def run_aisdk(port: int, conn: Connection, thread: Thread) -> Run:
    del conn
    thread.id = thread.id or f"bench-{uuid.uuid4().hex}"
    thread.runs += 1
    question = {"id": f"u{thread.runs}", "role": "user", "parts": [{"type": "text", "text": QUESTION}]}
    body = {
        "id": thread.id,
        "messages": [*thread.messages, question],
        "trigger": "submit-message",
        "agent": AGENT,
    }
    reply = await exchange(port, "POST", ROUTES["ai-sdk"], body)
    _refused("ai-sdk", reply)
    parts: list[str] = []
    tools = 0
    finish: dict[str, Any] = {}
    deltas: list[int] = []
    for (_, data), size in zip(reply.frames, reply.sizes, strict=True):
        if data == "[DONE]":
            continue
        chunk = orjson.loads(data)
        kind = chunk.get("type")
        if kind == "text-delta":
            parts.append(chunk.get("delta") or "")
            deltas.append(overhead(size, parts[-1]))
        elif kind == "tool-output-available":
            tools += 1
        elif kind == "finish":
            finish = chunk
    ended = "ok"
    status = (finish.get("messageMetadata") or {}).get("status")
    if not reply.frames or reply.frames[-1][1] != "[DONE]":
        ended = "no [DONE] at the end"
    elif finish.get("finishReason") != "stop" or status != "completed":
        ended = f"finish {str(finish)[:200]}"
    return Run("".join(parts), tools, ended, reply, reply.out_bytes, deltas)


async def run_agui(port: int, conn: Connection, thread: Thread) -> Run:
    del conn
    thread.id = thread.id or f"bench-{uuid.uuid4().hex}"
    thread.runs += 1
    body = {
        "threadId": thread.id,
        "runId": f"bench-run-{uuid.uuid4().hex[:12]}",
        "messages": [*thread.messages, {"id": f"u{thread.runs}", "role": "user", "content": QUESTION}],
        "tools": [],
        "context": [],
        "state": {},
        "forwardedProps": {"agent": AGENT},
        "protocolVersion": "1.0",
    }
    reply = await exchange(port, "POST", ROUTES["ag-ui"], body)
    _refused("ag-ui", reply)
    thread.snapshot = False
    parts: list[str] = []
    tools = 0
    last: dict[str, Any] = {}
    deltas: list[int] = []
    for (_, data), size in zip(reply.frames, reply.sizes, strict=True):
        last = orjson.loads(data)
        kind = last.get("type")
        if kind == "TEXT_MESSAGE_CONTENT":
            parts.append(last.get("delta") or "")
            deltas.append(overhead(size, parts[-1]))
        elif kind == "TOOL_CALL_RESULT":
            tools += 1
        elif kind == "MESSAGES_SNAPSHOT":
            thread.messages = list(last.get("messages") or ())  # what the client holds now
            thread.snapshot = True
    answer = "".join(parts)
    ended = "ok"
    if last.get("type") != "RUN_FINISHED" or (last.get("result") or {}).get("answer") != answer:
        ended = f"last event {str(last)[:200]}"
    return Run(answer, tools, ended, reply, reply.out_bytes, deltas)


RUNNERS: dict[str, Callable[[int, Connection, Thread], Awaitable[Run]]] = {
    "own": run_own,
    "ai-sdk": run_aisdk,
    "ag-ui": run_agui,
}


async def remember(port: int, conn: Connection, subject: str, thread: Thread) -> None:
    """After a run of a thread: the history its client now holds, as the client would send it back.

    The AI SDK client holds the messages folded from the chunks, which ``GET .../messages`` gives
    (the face's tests hold them equal); a separate request, so it is made outside the run's CPU
    window. The AG-UI client holds the last ``MESSAGES_SNAPSHOT`` (taken while reading the stream);
    a response without one leaves it the messages its events built, which the thread's snapshot
    equals: asked for then with a request that brings nothing new. The own API's client sends no
    history.
    """
    if subject == "ai-sdk":
        status, messages = await conn.request("GET", f"{ROUTES['ai-sdk']}/{thread.id}/messages")
        if status != 200:
            raise WrongRunError(f"ai-sdk: GET .../messages answered {status}")
        thread.messages = list(messages)
    elif subject == "ag-ui" and not thread.snapshot:
        body = {
            "threadId": thread.id,
            "runId": f"bench-sync-{uuid.uuid4().hex[:12]}",
            "messages": thread.messages,
            "tools": [],
            "context": [],
            "state": {},
            "forwardedProps": {},
            "protocolVersion": "1.0",
        }
        reply = await exchange(port, "POST", ROUTES["ag-ui"], body)
        snapshots = [orjson.loads(d) for _, d in reply.frames if '"MESSAGES_SNAPSHOT"' in d]
        if reply.status != 200 or not snapshots:
            raise WrongRunError(f"ag-ui: the thread's snapshot: {reply.status} {reply.text[:200]!r}")
        thread.messages = list(snapshots[-1].get("messages") or ())


def check(subject: str, run: Run, tool_results: int, expected: str) -> None:
    if run.tool_results != tool_results or run.answer != expected or run.ended != "ok":
        raise WrongRunError(
            f"{subject}: expected {tool_results} tool results and the fake's answer, got "
            f"{run.tool_results} and {run.answer[:60]!r}... ({len(run.answer)} chars); end: {run.ended}"
        )
