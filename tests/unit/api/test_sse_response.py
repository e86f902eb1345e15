"""``EventStream`` at the ASGI level: pings while quiet, the end of a stream from either side, the send
timeout and the server's shutdown, with no helper task left behind and none ended by an exception.

The wire itself (uvicorn, a real client) is in tests/integration/service/test_stream_wire.py and
tests/integration/reliability/test_slow_clients.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sse_starlette.sse import AppStatus
from starlette.types import Message

from app.api.routes.stream import ping_event
from app.api.sse_response import EventStream


class Client:
    """The server side of one HTTP exchange as uvicorn presents it to the app."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.changed = asyncio.Event()
        self.gone = asyncio.Event()
        self.stalled = False  # sends wait as they do when the client stops reading
        self.receives = 0
        self._requested = False

    async def receive(self) -> Message:
        self.receives += 1
        if not self._requested:
            self._requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.stalled:
            await asyncio.Event().wait()
        self.sent.append(message)
        self.changed.set()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.gone.set()  # a complete response: uvicorn's receive() returns http.disconnect

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(5):
            while not condition():
                self.changed.clear()
                await self.changed.wait()


SCOPE = {"type": "http", "method": "GET", "path": "/stream", "headers": []}
PING = b": ping\n\n"


def response(body: AsyncIterator[bytes], *, ping: float = 15.0, send_timeout: float = 60.0) -> EventStream:
    return EventStream(body, ping=ping, ping_message_factory=ping_event, sep="\n", send_timeout=send_timeout)


async def serve(stream: EventStream, client: Client) -> asyncio.Task[None]:
    return asyncio.create_task(stream(SCOPE, client.receive, client.send))


@pytest.fixture
async def helpers() -> AsyncIterator[Callable[[], Awaitable[list[asyncio.Task[Any]]]]]:
    """Records the tasks the streams start; the callable waits for the helpers among them to end
    and returns them."""
    loop = asyncio.get_running_loop()
    created: list[asyncio.Task[Any]] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        created.append(task)
        return task

    async def ended() -> list[asyncio.Task[Any]]:
        mine = [t for t in created if t.get_name() in ("sse-watcher", "sse-shutdown-poller")]
        if mine:
            await asyncio.wait(mine, timeout=5)
        assert all(t.done() for t in mine), "a helper task of the stream is still running"
        return mine

    loop.set_task_factory(factory)
    yield ended
    loop.set_task_factory(None)


Helpers = Callable[[], Awaitable[list[asyncio.Task[Any]]]]


class Body:
    """An SSE body the test feeds; records whether its clean-up ran."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while (item := await self.queue.get()) is not None:
                yield item
        finally:
            self.closed = True


async def test_a_quiet_stream_pings_and_a_complete_one_leaves_no_task_behind(helpers: Helpers) -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events(), ping=0.05), client)

    await client.wait_for(lambda: client.bodies().count(PING) >= 3)
    body.queue.put_nowait(b"id: 1-0\nevent: done\ndata: {}\n\n")
    body.queue.put_nowait(None)
    await asyncio.wait_for(served, 5)

    assert client.sent[0]["type"] == "http.response.start"
    assert client.sent[0]["status"] == 200
    bodies = client.bodies()
    assert bodies[-2:] == [b"id: 1-0\nevent: done\ndata: {}\n\n", b""]
    assert set(bodies[:-2]) == {PING}
    assert body.closed
    ended = await helpers()
    assert ended, "the stream ran no watcher"
    assert all(not t.cancelled() and t.exception() is None for t in ended)


async def test_a_stream_that_keeps_sending_is_not_pinged() -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events(), ping=2.0), client)
    loop = asyncio.get_running_loop()
    until = loop.time() + 3.0  # longer than the ping interval, with an event at least every 0.5 s
    while loop.time() < until:
        body.queue.put_nowait(b"data: x\n\n")
        await client.wait_for(lambda: client.bodies()[-1:] == [b"data: x\n\n"])
        client.sent.clear()
        await asyncio.sleep(0.02)  # the pace of the events, not a synchronisation
    body.queue.put_nowait(None)
    await asyncio.wait_for(served, 5)

    assert PING not in client.bodies()


async def test_a_client_that_goes_ends_the_stream_and_its_body_runs_its_clean_up(helpers: Helpers) -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events()), client)
    body.queue.put_nowait(b"data: a\n\n")
    await client.wait_for(lambda: b"data: a\n\n" in client.bodies())

    client.gone.set()
    await asyncio.wait_for(served, 5)  # returns, without an error

    assert body.closed
    assert b"" not in client.bodies()  # nothing more is sent to a client that left
    assert all(t.exception() is None for t in await helpers())


async def test_a_send_that_waits_past_the_send_timeout_drops_the_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events(), send_timeout=0.2), client)
    await client.wait_for(lambda: len(client.sent) == 1)  # the response's start
    client.stalled = True
    body.queue.put_nowait(b"data: never taken\n\n")

    with caplog.at_level(logging.INFO, logger="app.api.stream"):
        await asyncio.wait_for(served, 5)

    assert body.closed
    assert "dropped a stream client that stopped reading" in caplog.text
    assert client.bodies() == []


async def test_a_ping_the_client_does_not_take_drops_it_too() -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events(), ping=0.05, send_timeout=0.2), client)
    await client.wait_for(lambda: len(client.sent) == 1)
    client.stalled = True

    await asyncio.wait_for(served, 5)

    assert body.closed


async def test_a_send_that_waits_while_pings_are_due_does_not_spin_the_watcher() -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events(), ping=0.01, send_timeout=0.5), client)
    await client.wait_for(lambda: len(client.sent) == 1)
    client.stalled = True
    body.queue.put_nowait(b"data: never taken\n\n")  # waits for the send timeout, pings long due

    await asyncio.wait_for(served, 5)

    assert body.closed
    # One wait for the timeout (and a few pings' before the send began), not one per loop turn.
    assert client.receives < 10, f"the watcher called receive() {client.receives} times"


@pytest.fixture
def exit_signal() -> Any:
    yield lambda: setattr(AppStatus, "should_exit", True)
    AppStatus.should_exit = False


async def test_the_server_shutting_down_ends_open_streams_cleanly(
    exit_signal: Callable[[], None], helpers: Helpers
) -> None:
    clients = [Client() for _ in range(3)]
    bodies = [Body() for _ in clients]
    served = [await serve(response(b.events()), c) for c, b in zip(clients, bodies, strict=True)]
    bodies[0].queue.put_nowait(b"data: a\n\n")
    await clients[0].wait_for(lambda: b"data: a\n\n" in clients[0].bodies())

    exit_signal()
    await asyncio.wait_for(asyncio.gather(*served), 5)

    for client, body in zip(clients, bodies, strict=True):
        assert client.bodies()[-1] == b"", "the body did not end cleanly"
        assert body.closed
    assert all(t.exception() is None for t in await helpers())


async def test_a_cancel_from_outside_the_stream_is_not_swallowed(helpers: Helpers) -> None:
    client, body = Client(), Body()
    served = await serve(response(body.events()), client)
    await client.wait_for(lambda: len(client.sent) == 1)

    served.cancel()
    with pytest.raises(asyncio.CancelledError):
        await served
    assert body.closed
    assert [t.cancelled() for t in await helpers() if t.get_name() == "sse-watcher"] == [True]


async def test_a_body_that_fails_raises_and_stops_the_watcher(helpers: Helpers) -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"data: a\n\n"
        raise RuntimeError("boom")

    client = Client()
    served = await serve(response(failing()), client)
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(served, 5)
    watchers = await helpers()
    assert watchers, "the stream ran no watcher"
    assert all(t.cancelled() for t in watchers if t.get_name() == "sse-watcher")
    assert any(t.get_name() == "sse-watcher" for t in watchers)


class SlowToFinishClient(Client):
    """uvicorn marks the response complete as soon as its last body message is handed over, then
    may wait for the transport before ``receive()`` reports the end: a message sent meanwhile is an
    error there (``RuntimeError``)."""

    def __init__(self) -> None:
        super().__init__()
        self.completed = False
        self.late: list[Message] = []

    async def receive(self) -> Message:
        if self._requested:
            await asyncio.sleep(0.3)  # the end is reported late: six ping intervals pass first
            await self.gone.wait()
        return await super().receive()

    async def send(self, message: Message) -> None:
        if self.completed:
            self.late.append(message)
            raise RuntimeError("Unexpected ASGI message after response already completed.")
        self.completed = message["type"] == "http.response.body" and not message.get("more_body", False)
        await super().send(message)


async def test_no_ping_goes_out_after_the_response_completed(helpers: Helpers) -> None:
    client, body = SlowToFinishClient(), Body()
    served = await serve(response(body.events(), ping=0.05), client)
    body.queue.put_nowait(b"id: 1-0\nevent: done\ndata: {}\n\n")
    body.queue.put_nowait(None)

    await asyncio.wait_for(served, 5)
    await helpers()

    assert client.late == []
    ended = await helpers()
    assert ended and all(not t.cancelled() and t.exception() is None for t in ended)
