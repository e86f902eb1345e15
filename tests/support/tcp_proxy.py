"""A TCP proxy that a test can cut, to take a server (PostgreSQL, say) away from the service and back.

``TcpProxy(upstream_host, upstream_port)`` listens on a free loopback port and pipes every
connection to the upstream server. It runs its own event loop in a background thread, so sync
tests, async tests and subprocesses can all go through it::

    with TcpProxy("127.0.0.1", 5432) as proxy:
        url = f"postgresql+asyncpg://postgres@127.0.0.1:{proxy.port}/db"
        proxy.cut()       # every piped connection is reset; new connections are refused
        proxy.restore()   # listening again on the same port

``connections`` counts the connections accepted so far, ``open_connections`` those still piped.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from types import TracebackType

_CHUNK = 65536


class TcpProxy:
    """See the module docstring. Use as a context manager or call ``start()``/``stop()``."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = 0
        self.connections = 0
        self._pipes: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        if self._thread is not None:
            raise RuntimeError("TcpProxy already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- faults -------------------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def open_connections(self) -> int:
        return len(self._pipes)

    def cut(self) -> int:
        """Stop listening (new connections are refused) and reset every piped connection.

        Returns how many connections were reset.
        """
        return int(self._call(self._cut()))

    def restore(self) -> None:
        """Listen again on the same port."""
        self._call(self._listen())

    # -- internals ----------------------------------------------------------------------------

    def _call(self, coro: object) -> object:
        assert self._loop is not None, "TcpProxy is not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        if self._server is not None:
            return
        # SO_REUSEADDR (asyncio's default on Unix): the port is ours again at once after a cut.
        self._server = await asyncio.start_server(
            self._accept, self.host, self.port, reuse_address=True, family=socket.AF_INET
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> int:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        pipes = list(self._pipes)
        for client, upstream in pipes:
            # abort(): an RST, not a polite FIN, like a network that went away.
            client.transport.abort()
            upstream.transport.abort()
        self._pipes.clear()
        return len(pipes)

    async def _shutdown(self) -> None:
        await self._cut()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            try:
                upstream_reader, upstream = await asyncio.open_connection(*self.upstream)
            except OSError:
                client.transport.abort()
                return
            pipe = (client, upstream)
            self._pipes.add(pipe)
            try:
                await asyncio.gather(
                    _pump(client_reader, upstream), _pump(upstream_reader, client), return_exceptions=True
                )
            finally:
                self._pipes.discard(pipe)
                for writer in pipe:
                    writer.transport.abort()
        finally:
            self._tasks.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either side ends; then end the other."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()
