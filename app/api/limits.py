"""An ASGI middleware that refuses request bodies over a size limit with 413, before they are read."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 1_000_000


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = chunked = False
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                    declared = True
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send)
                    return
            elif name == b"transfer-encoding":
                chunked = True
        if not chunked and (declared or scope.get("http_version") in ("1.0", "1.1")):
            # A body of a declared length within the limit (the server reads no more than that),
            # or, in HTTP/1, none at all: nothing to count, and the response's sends (every event
            # of a stream) pass through no wrapper of ours. (HTTP/2 frames a body without either
            # header: counted.)
            await self.app(scope, receive, send)
            return
        received = 0
        started = False
        rejected = False

        async def limited_receive() -> Message:
            nonlocal received, started, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # A body without Content-Length (chunked) grew too large. An exception raised
                    # here would reach the app's body parser, which answers it with a 400; so the
                    # 413 goes out now and the app is told that the client went away.
                    rejected = True
                    if not started:
                        started = True
                        await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413 is the answer; whatever the app says after it is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, tracking_send)

    async def _reject(self, send: Send) -> None:
        body = orjson.dumps(
            {"error": {"code": "too_large", "message": f"request body exceeds {self.max_bytes} bytes"}}
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
