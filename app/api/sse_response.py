"""``EventStream``: the SSE response of both stream routes, one task per stream besides the request's.

sse-starlette's ``EventSourceResponse`` runs every stream in a task group of four tasks (the body,
pings, a disconnect listener and a shutdown listener) and wraps every send in a cancel scope for its
send timeout. With hundreds of streams that was a measurable share of the worker's CPU, and every
finished stream left the cancelled helpers' exceptions, tracebacks and frames behind as cyclic
garbage, which the collector's full passes (tens of milliseconds, the whole event loop held) then had
to walk. Here the body is sent from the request's own task, and one watcher task per stream waits for
the client to go, sends ``: ping`` while the stream is quiet, and drops a client whose send has
waited longer than the send timeout. A stream that ends with its last event ends its watcher without
an exception: the final empty body completes the response, which is what the watcher's ``receive()``
waits for. One poller per process ends the open streams when the server shuts down (sse-starlette's
``AppStatus``, set by uvicorn's exit handler, which sse-starlette patches when imported).

Headers, the separator and the ping event are still sse-starlette's (this is its subclass).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Literal

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.event import ensure_bytes
from sse_starlette.sse import AppStatus
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("app.api.stream")

Stop = Literal["disconnect", "send_timeout", "shutdown"]

SHUTDOWN_POLL_S = 0.25
"""How often the process's poller looks for the server's exit signal while streams are open."""
FAREWELL_TIMEOUT_S = 5.0
"""How long the final empty body of a stream ended by shutdown may wait for a slow client."""


class EventStream(EventSourceResponse):
    """Server-sent events from ``content``; see the module's docstring for how it runs."""

    _loop: asyncio.AbstractEventLoop
    _main: asyncio.Task[object]
    _sending_since: float | None
    _last_sent: float
    _stop: Stop | None
    _finished: bool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        main = asyncio.current_task()
        if scope["type"] != "http" or scope["method"].upper() == "HEAD" or main is None:
            await super().__call__(scope, receive, send)
            return
        self._loop = asyncio.get_running_loop()
        self._main = main
        self._sending_since = None
        self._last_sent = self._loop.time()
        self._stop = None
        self._finished = False

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = self._loop.create_task(self._watch(receive, send), name="sse-watcher")
        streams = _open_streams(self._loop)
        streams.add(self)
        completed = False
        try:
            completed = await self._send_body(send)
        finally:
            streams.discard(self)
            # After a complete response the watcher's receive() returns and it ends by itself.
            if not completed and not watcher.done():
                watcher.cancel()
        if self.background is not None:
            await self.background()

    async def _send_body(self, send: Send) -> bool:
        """Send the body; whether the response was completed (its final empty body sent)."""
        loop = self._loop
        try:
            async for data in self.body_iterator:
                message = {
                    "type": "http.response.body",
                    "body": ensure_bytes(data, self.sep),
                    "more_body": True,
                }
                self._sending_since = loop.time()
                await send(message)
                self._sending_since = None
                self._last_sent = loop.time()
            self._finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        except asyncio.CancelledError:
            if self._stop is None or self._main.uncancel() > 0:
                raise  # cancelled by someone else (the server giving up on its requests)
            return await self._ended_from_outside(send)

    async def _ended_from_outside(self, send: Send) -> bool:
        """The watcher or the shutdown poller stopped the stream; the request ends without an error."""
        self._finished = True
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()  # stopped in a send: the body's own clean-up runs now
        if self._stop == "send_timeout":
            # No fault of the server's, and the client loses nothing: it reconnects with its cursor.
            log.info(
                "dropped a stream client that stopped reading", extra={"send_timeout_s": self.send_timeout}
            )
        elif self._stop == "shutdown":
            # End the body cleanly so that the client sees a closed stream and reconnects elsewhere.
            try:
                async with asyncio.timeout(FAREWELL_TIMEOUT_S):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return True
            except (TimeoutError, OSError):
                pass
        return False

    def stop(self, reason: Stop) -> None:
        """End the stream from outside its task: at its next await, as if its body had ended."""
        if self._stop is None and not self._finished:
            self._stop = reason
            self._main.cancel()

    async def _watch(self, receive: Receive, send: Send) -> None:
        loop = self._loop
        ping_s = self.ping_interval or math.inf
        send_timeout_s = self.send_timeout or math.inf
        while True:
            # While a send waits, the next thing due is its timeout; otherwise the next ping. A send
            # that begins meanwhile is seen within a quarter of the timeout.
            since = self._sending_since
            due = since + send_timeout_s if since is not None else self._last_sent + ping_s
            wait = min(due - loop.time(), send_timeout_s / 4)
            try:
                async with asyncio.timeout(None if math.isinf(wait) else max(0.0, wait)):
                    message: Message = await receive()
            except TimeoutError:
                if self._finished:
                    return  # the body is over: no ping after its last message
                since = self._sending_since
                now = loop.time()
                if since is not None:
                    if now - since >= send_timeout_s:
                        self.stop("send_timeout")
                        return
                elif now - self._last_sent >= ping_s and not await self._send_ping(send):
                    self.stop("send_timeout")
                    return
                continue
            if message["type"] == "http.disconnect":
                self.stop("disconnect")  # nothing to do if the response is complete
                return

    async def _send_ping(self, send: Send) -> bool:
        """Send ``: ping``; False if the client did not take it within the send timeout."""
        factory = self.ping_message_factory
        event = factory() if factory is not None else ServerSentEvent(comment="ping", sep=self.sep)
        body = ensure_bytes(event, self.sep)
        try:
            async with asyncio.timeout(self.send_timeout):
                await send({"type": "http.response.body", "body": body, "more_body": True})
        except TimeoutError:
            return False
        self._last_sent = self._loop.time()
        return True


_streams: dict[asyncio.AbstractEventLoop, set[EventStream]] = {}


def _open_streams(loop: asyncio.AbstractEventLoop) -> set[EventStream]:
    """This loop's open streams; the first one starts the loop's shutdown poller, which ends when
    no stream is open any more."""
    streams = _streams.get(loop)
    if streams is None:
        streams = _streams[loop] = set()
        loop.create_task(_end_at_shutdown(loop, streams), name="sse-shutdown-poller")
    return streams


async def _end_at_shutdown(loop: asyncio.AbstractEventLoop, streams: set[EventStream]) -> None:
    try:
        while streams:
            if AppStatus.should_exit:
                for stream in list(streams):
                    stream.stop("shutdown")
            await asyncio.sleep(SHUTDOWN_POLL_S)
    finally:
        if _streams.get(loop) is streams:
            del _streams[loop]
