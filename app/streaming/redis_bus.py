"""``RedisEventBus``: the event bus shared by every worker, one Redis Stream per conversation.

Writes are one pipelined round trip per batch, with the ids the publisher assigned. Reads for live
delivery are shared: each process runs ONE reader task per followed conversation (``XREAD BLOCK``
on a connection of its own) that fans entries out to that conversation's local followers through
bounded per-follower buffers. A follower that falls too far behind loses its buffer and catches up
from the stream by id (``XRANGE``), so a slow client never stalls the others nor grows memory.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.streaming.bus import (
    BusClosedError,
    BusUnavailableError,
    EventOrderError,
    StoredEvent,
    parse_cursor,
)

log = logging.getLogger("app.streaming.redis")

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
_PAGE = 1000


def _events(entries: Sequence[tuple[str, dict[str, str]]]) -> list[StoredEvent]:
    return [StoredEvent(entry_id, f["event"], f["data"], f["run_id"]) for entry_id, f in entries]


class _StreamLostError(Exception):
    """Internal: the stream no longer vouches for continuity; surfaced as ``BusUnavailableError``."""


class _Follower:
    """One ``follow()`` call's share of a reader: batches not yet yielded, at most ``limit`` events."""

    __slots__ = ("batches", "error", "overflowed", "size", "wakeup")

    def __init__(self) -> None:
        self.batches: deque[list[StoredEvent]] = deque()
        self.size = 0
        self.overflowed = False
        self.error: BaseException | None = None
        self.wakeup = asyncio.Event()


class _StreamReader:
    """The process's single blocking reader of one conversation's stream."""

    def __init__(self, bus: RedisEventBus, conversation_id: str, position: str) -> None:
        self.bus = bus
        self.conversation_id = conversation_id
        self.key = bus.stream_key(conversation_id)
        # Id of the last entry handed to followers; every follower registered now gets all after it.
        self.position = position
        self.followers: set[_Follower] = set()
        self.stopped = False
        self.task = asyncio.create_task(self._run(), name=f"stream-reader-{conversation_id}")

    def add(self, follower: _Follower) -> None:
        self.followers.add(follower)

    def remove(self, follower: _Follower) -> None:
        self.followers.discard(follower)

    async def _run(self) -> None:
        try:
            while self.followers:
                try:
                    reply: Any = await self.bus.blocking.xread(
                        {self.key: self.position}, count=_PAGE, block=self.bus.block_ms
                    )
                except _UNREACHABLE as exc:
                    self._fail(BusUnavailableError(f"stream reader lost Redis: {exc}"))
                    return
                except RedisError as exc:
                    self._fail(BusUnavailableError(f"stream reader failed: {exc}"))
                    return
                if not reply:
                    continue
                events = _events(reply[0][1])
                if events:
                    self.position = events[-1].id
                    self._fan_out(events)
        except asyncio.CancelledError:
            self._fail(BusClosedError("the event bus is closed"))
            raise
        finally:
            self.stopped = True
            if self.bus.readers.get(self.conversation_id) is self:
                del self.bus.readers[self.conversation_id]

    def _fan_out(self, events: list[StoredEvent]) -> None:
        limit = self.bus.follower_buffer
        n = len(events)
        for follower in list(self.followers):
            if follower.size + n > limit:
                # Too far behind: forget its buffer; it re-reads from the stream by id.
                follower.overflowed = True
                follower.batches.clear()
                follower.size = 0
                self.followers.discard(follower)
            else:
                follower.batches.append(events)
                follower.size += n
            follower.wakeup.set()

    def _fail(self, error: BaseException) -> None:
        for follower in self.followers:
            follower.error = error
            follower.wakeup.set()
        self.followers.clear()


class RedisEventBus:
    """``EventBus`` on Redis Streams (``{prefix}:events:{conversation_id}``).

    ``maxlen`` caps a stream approximately (older entries are then served from the database);
    ``follower_buffer`` bounds, in events, what one follower may have pending before it is sent
    back to catch up by id; ``reconnect_s`` is how long ``follow()`` retries an unreachable Redis
    before it raises ``BusUnavailableError``; ``client_name`` names its connections in
    ``CLIENT LIST``.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        maxlen: int | None = 100_000,
        block_ms: int = 1000,
        follower_buffer: int = 4096,
        reconnect_s: float = 10.0,
        socket_timeout_s: float = 5.0,
        client_name: str | None = "agentstream-bus",
    ) -> None:
        self.prefix = prefix
        self.maxlen = maxlen
        self.block_ms = block_ms
        self.follower_buffer = follower_buffer
        self.reconnect_s = reconnect_s
        # No hidden retries in the client: callers own retry policy (the publisher keeps order,
        # follow() re-checks for lost entries), and a retried pipeline could double-append.
        common: dict[str, Any] = {
            "decode_responses": True,
            "protocol": 2,
            "retry": Retry(NoBackoff(), 0),
            "socket_connect_timeout": socket_timeout_s,
            "client_name": client_name,
        }
        self.redis: Redis = Redis.from_url(url, socket_timeout=socket_timeout_s, **common)
        # Blocking reads hold their connection for up to block_ms: they get a pool of their own so
        # they never starve appends and replays.
        self.blocking: Redis = Redis.from_url(
            url, socket_timeout=block_ms / 1000 + socket_timeout_s, **common
        )
        self.readers: dict[str, _StreamReader] = {}
        self._closed = False

    def stream_key(self, conversation_id: str) -> str:
        return f"{self.prefix}:events:{conversation_id}"

    # ---- writing ---------------------------------------------------------------------------

    async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        self._check_open()
        if not events:
            return
        key = self.stream_key(conversation_id)
        pipe = self.redis.pipeline(transaction=False)
        for event in events:
            pipe.xadd(
                key,
                {"event": event.event, "data": event.data, "run_id": event.run_id},
                id=event.id,
                maxlen=self.maxlen,
                approximate=True,
            )
        # A new run must not inherit the expiry the previous run's done set on the stream.
        pipe.persist(key)
        try:
            results = await pipe.execute(raise_on_error=False)
        except _UNREACHABLE as exc:
            raise BusUnavailableError(f"cannot append to {key}: {exc}") from exc
        for event, result in zip(events, results, strict=False):
            if isinstance(result, ResponseError):
                if "equal or smaller" in str(result):
                    raise EventOrderError(
                        f"Redis rejected event id {event.id} for {key}: not greater than the newest id held"
                    ) from result
                raise BusUnavailableError(f"cannot append to {key}: {result}") from result

    async def expire(self, conversation_id: str, seconds: int) -> None:
        await self._call(self.redis.expire, self.stream_key(conversation_id), max(1, int(seconds)))

    async def delete(self, conversation_id: str) -> None:
        await self._call(self.redis.delete, self.stream_key(conversation_id))

    # ---- reading ---------------------------------------------------------------------------

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        return await self._read_range(conversation_id, after, "+", limit)

    async def _read_range(self, conversation_id: str, after: str, upto: str, limit: int) -> list[StoredEvent]:
        key = self.stream_key(conversation_id)
        return _events(await self._call(self.redis.xrange, key, f"({after}", upto, limit))

    async def oldest_id(self, conversation_id: str) -> str | None:
        entries = await self._call(self.redis.xrange, self.stream_key(conversation_id), "-", "+", 1)
        return str(entries[0][0]) if entries else None

    async def last_id(self, conversation_id: str) -> str | None:
        entries = await self._call(self.redis.xrevrange, self.stream_key(conversation_id), "+", "-", 1)
        return str(entries[0][0]) if entries else None

    async def follow(self, conversation_id: str, after: str) -> AsyncIterator[StoredEvent]:
        last = after
        last_key = parse_cursor(after)
        failing_since: float | None = None
        verify = False
        attempt = 0
        while True:
            self._check_open()
            follower = _Follower()
            reader: _StreamReader | None = None
            try:
                if verify:
                    # Back after an outage or a fall-behind: only go on if the stream still holds what
                    # we had (Redis may have restarted empty, or trimmed): else entries may be lost.
                    if not await self._still_holds(conversation_id, last_key):
                        raise _StreamLostError(f"stream of {conversation_id} no longer holds {last}")
                    verify = False
                # Replay what the stream holds, then subscribe and dedupe by id across the seam.
                while True:
                    batch = await self.read_after(conversation_id, last, _PAGE)
                    for event in batch:
                        yield event
                    if batch:
                        last = batch[-1].id
                        last_key = parse_cursor(last)
                    if len(batch) < _PAGE:
                        break
                self._check_open()
                reader = self.readers.get(conversation_id)
                if reader is None or reader.stopped:
                    reader = self.readers[conversation_id] = _StreamReader(self, conversation_id, last)
                registered_at = reader.position
                reader.add(follower)
                # Entries the reader handed out before we joined were appended after our replay.
                while parse_cursor(registered_at) > last_key:
                    batch = await self._read_range(conversation_id, last, registered_at, _PAGE)
                    if not batch:
                        break
                    for event in batch:
                        yield event
                    last = batch[-1].id
                    last_key = parse_cursor(last)
                failing_since = None
                attempt = 0
                while True:
                    if follower.batches:
                        batch = follower.batches.popleft()
                        follower.size -= len(batch)
                        for event in batch:
                            key = parse_cursor(event.id)
                            if key > last_key:
                                yield event
                                last, last_key = event.id, key
                        continue
                    if follower.error is not None:
                        raise follower.error
                    if follower.overflowed:
                        verify = True
                        break  # catch up from the stream by id
                    follower.wakeup.clear()
                    await follower.wakeup.wait()
            except _StreamLostError as exc:
                raise BusUnavailableError(str(exc)) from None
            except BusUnavailableError:
                verify = True
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                elif now - failing_since > self.reconnect_s:
                    raise
                attempt += 1
                await asyncio.sleep(min(1.0, 0.02 * 2.0**attempt) * (0.5 + random.random() / 2))
            finally:
                if reader is not None:
                    reader.remove(follower)

    async def _still_holds(self, conversation_id: str, key: tuple[int, int]) -> bool:
        """Whether the stream still holds an entry at or before ``key`` (so nothing after it was lost)."""
        oldest = await self.oldest_id(conversation_id)
        return oldest is not None and parse_cursor(oldest) <= key

    # ---- service ---------------------------------------------------------------------------

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        self._closed = True
        readers = list(self.readers.values())
        for reader in readers:
            reader.task.cancel()
        for reader in readers:
            try:
                await reader.task
            except asyncio.CancelledError:
                pass
        self.readers.clear()
        await self.redis.aclose()
        await self.blocking.aclose()

    # ---- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosedError("the event bus is closed")

    async def _call(self, method: Any, *args: Any) -> Any:
        self._check_open()
        try:
            return await method(*args)
        except _UNREACHABLE as exc:
            raise BusUnavailableError(f"Redis unreachable: {exc}") from exc
        except ResponseError as exc:
            raise BusUnavailableError(f"Redis refused: {exc}") from exc
