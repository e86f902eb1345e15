"""``RespConnection``: a bare Redis connection for the event bus's two hot paths.

The stream writer sends one pipeline per batch of appends and the stream reader one blocking
``XREAD`` at a time; each owns one of these (on a Redis Cluster, one per master listens to the
channels that announce appends: ``send``/``receive``, subscribe mode). Commands are packed and
replies parsed by hiredis (C), with one timeout per round trip instead of one per reply, which
makes a token cost microseconds instead of a redis-py command's overhead. Everything else in the
service uses redis-py.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

Command = tuple[str | bytes | int, ...]
"""A command as its arguments; ``execute`` also takes one already packed as RESP ``bytes``."""


def bulk(value: str) -> bytes:
    """``value`` as a RESP bulk string, to pack a command from parts kept between calls."""
    data = value.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def array_header(length: int) -> bytes:
    return b"*%d\r\n" % length


class RespConnection:
    """One lazily (re)connected RESP2 connection, used by one task at a time.

    Any failure closes it (the next ``execute`` reconnects) and raises ``redis.ConnectionError``;
    error replies are returned as ``ResponseError`` instances in the reply list, not raised.
    """

    def __init__(
        self, url: str, *, client_name: str | None, timeout_s: float, address: tuple[str, int] | None = None
    ) -> None:
        """``address`` (host, port) replaces the URL's, as for a node of a cluster ``url`` names."""
        self._options: dict[str, Any] = dict(parse_url(url))
        if address is not None:
            self._options.pop("path", None)
            self._options["host"], self._options["port"] = address
        self._client_name = client_name
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._parser: Any = None
        self.client_id: int | None = None
        """Redis's id of this connection (for ``CLIENT UNBLOCK``); None while disconnected."""

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def execute(self, commands: Sequence[Command | bytes], timeout_s: float | None = None) -> list[Any]:
        """Send ``commands`` in one write and return their replies, in order."""
        try:
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                if self._writer is not None and (self._writer.is_closing() or self._at_eof()):
                    self.close()  # Redis closed it while idle (restart, CLIENT KILL, timeout)
                if self._writer is None:
                    await self._connect()
                return await self._round_trip(commands)
        except asyncio.CancelledError:
            # A half-read reply would poison the next command: never reuse this connection.
            self.close()
            raise
        except (OSError, TimeoutError, EOFError, hiredis.ProtocolError, RedisConnectionError) as exc:
            self.close()
            raise RedisConnectionError(f"Redis connection failed: {exc!r}") from exc

    async def connect(self) -> None:
        """Connect now (for ``send``), if not connected."""
        await self.execute([])

    def send(self, commands: Sequence[Command]) -> None:
        """Write ``commands`` without waiting for their replies (in subscribe mode ``receive``
        returns them, among the messages)."""
        if self._writer is None or self._writer.is_closing():
            raise RedisConnectionError("Redis connection is closed")
        pack: Any = hiredis.pack_command
        self._writer.write(b"".join(pack(c) for c in commands))

    async def receive(self, timeout_s: float) -> Any:
        """The next reply or message; ``None`` if none came within ``timeout_s``."""
        assert self._reader is not None, "receive() before connect()"
        parser = self._parser
        try:
            async with asyncio.timeout(timeout_s):
                while (reply := parser.gets()) is False:
                    data = await self._reader.read(262_144)
                    if not data:
                        raise RedisConnectionError("Redis closed the connection")
                    parser.feed(data)
                return reply
        except TimeoutError:
            return None
        except asyncio.CancelledError:
            self.close()
            raise
        except (OSError, EOFError, hiredis.ProtocolError, RedisConnectionError) as exc:
            self.close()
            raise RedisConnectionError(f"Redis connection failed: {exc!r}") from exc

    def _at_eof(self) -> bool:
        return self._reader is not None and self._reader.at_eof()

    async def _round_trip(self, commands: Sequence[Command | bytes]) -> list[Any]:
        assert self._writer is not None and self._reader is not None
        pack: Any = hiredis.pack_command
        self._writer.write(b"".join(c if type(c) is bytes else pack(c) for c in commands))
        replies: list[Any] = []
        parser = self._parser
        while len(replies) < len(commands):
            reply = parser.gets()
            if reply is False:
                data = await self._reader.read(262_144)
                if not data:
                    raise RedisConnectionError("Redis closed the connection")
                parser.feed(data)
                continue
            replies.append(reply)
        return replies

    async def _connect(self) -> None:
        options = self._options
        if "path" in options:
            reader, writer = await asyncio.open_unix_connection(options["path"])
        else:
            context = (
                ssl.create_default_context() if options.get("connection_class") is SSLConnection else None
            )
            reader, writer = await asyncio.open_connection(
                options.get("host", "localhost"), int(options.get("port", 6379)), ssl=context
            )
        self._reader, self._writer = reader, writer
        self._parser = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        handshake: list[Command] = []
        if options.get("password"):
            if options.get("username"):
                handshake.append(("AUTH", options["username"], options["password"]))
            else:
                handshake.append(("AUTH", options["password"]))
        if int(options.get("db") or 0):
            handshake.append(("SELECT", int(options["db"])))
        if self._client_name:
            handshake.append(("CLIENT", "SETNAME", self._client_name))
        handshake.append(("CLIENT", "ID"))
        replies = await self._round_trip(handshake)
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise RedisConnectionError(f"Redis refused the connection setup: {reply}")
        self.client_id = int(replies[-1])

    def close(self) -> None:
        writer, self._writer, self._reader, self.client_id = self._writer, None, None, None
        if writer is not None:
            writer.close()

    async def aclose(self) -> None:
        writer = self._writer
        self.close()
        if writer is not None:
            try:
                await writer.wait_closed()
            except OSError:
                pass
