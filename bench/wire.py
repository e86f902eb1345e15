"""A small HTTP/1.1 client on raw asyncio streams, for load tests that must stay cheap and count bytes.

``request()`` does one request on its own connection and returns status, headers and body.
``SseStream`` opens ``GET`` on an event stream and yields ``(received_at_us, event, data)`` per event
as bytes arrive (chunked transfer decoded), counting every byte read off the socket. Loopback only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson


class HttpError(Exception):
    pass


def _head(method: str, path: str, host: str, port: int, body: bytes | None, extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}:{port}", "accept: */*", extra.rstrip("\r\n")]
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    return ("\r\n".join(x for x in lines if x) + "\r\n\r\n").encode() + (body or b"")


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], int]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    return status, headers, len(raw)


class Connection:
    """One keep-alive connection for plain JSON requests."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    async def request(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        reused = self.writer is not None
        try:
            return await self._request(method, path, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not reused:
                raise
            # The server closed the idle keep-alive connection: once more on a new one.
            await self.close()
            return await self._request(method, path, payload)

    async def _request(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        body = orjson.dumps(payload) if payload is not None else (b"" if method == "POST" else None)
        data = _head(method, path, self.host, self.port, body)
        self.writer.write(data)
        self.bytes_out += len(data)
        status, headers, n = await _read_head(self.reader)
        length = int(headers.get("content-length", "0"))
        raw = await self.reader.readexactly(length) if length else b""
        self.bytes_in += n + length
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, orjson.loads(raw) if raw else None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


class SseStream:
    """An event stream read off the socket; ``bytes_in`` counts everything received (headers too)."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.host, self.port, self.path = host, port, path
        self.bytes_in = 0
        self.status = 0
        self.pings = 0
        self.connected_us = 0
        self.last_id = ""
        """``id:`` of the event just yielded (AgentStream's ids start with the publish time in ms)."""
        """When the response headers arrived (time.time() in µs)."""
        self._writer: asyncio.StreamWriter | None = None

    async def events(self) -> AsyncIterator[tuple[int, str, str]]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._writer = writer
        try:
            writer.write(_head("GET", self.path, self.host, self.port, None, "accept: text/event-stream"))
            self.status, headers, n = await _read_head(reader)
            self.connected_us = time.time_ns() // 1000
            self.bytes_in += n
            if self.status != 200:
                return
            if headers.get("transfer-encoding", "").lower() != "chunked":
                raise HttpError("expected a chunked event stream")
            buffer = b""
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                chunk = await reader.readexactly(size + 2)
                received = time.time_ns() // 1000
                self.bytes_in += len(size_line) + size + 2
                if size == 0:
                    return
                # SSE allows CRLF, LF or CR line ends (sse-starlette's pings use CRLF, our events LF).
                buffer += chunk[:-2].replace(b"\r\n", b"\n")
                while b"\n\n" in buffer:
                    frame, buffer = buffer.split(b"\n\n", 1)
                    event, data = "", ""
                    self.last_id = ""
                    for line in frame.decode().split("\n"):
                        if line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("id: "):
                            self.last_id = line[4:]
                        elif line.startswith("data: "):
                            data = line[6:]
                        elif line.startswith(":"):
                            self.pings += 1
                    if event:
                        yield received, event, data
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
