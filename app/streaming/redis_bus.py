"""``RedisEventBus``: the event bus shared by every worker, one Redis Stream per conversation.

Writes carry the ids the publisher assigned. Appends of all conversations of a process go out
together, one pipelined round trip per batch (what queued up while the previous one was in
flight), so the cost per event is a few microseconds of packing, not a round trip.

Reads for live delivery are shared too: the process runs ONE reader task with ONE blocking
connection, ``XREAD BLOCK`` over every stream that has local followers, and fans entries out to
each conversation's followers through bounded per-follower buffers. No Redis connection per SSE
client, nor per conversation. A follower that falls too far behind loses its buffer and catches up
from the stream by id (``XRANGE``), so a slow client never stalls the others nor grows memory.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
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
from app.streaming.redis_wire import Command, RespConnection, array_header, bulk

log = logging.getLogger("app.streaming.redis")

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
_PAGE = 1000
_FOLLOWER_PAGE = 64
"""Entries one follower reads for itself at a time (replay, catch-up). A follower whose client
stopped reading holds its page until the client goes, so the page is small: at 1000 entries, 40
clients that stopped reading an 8 MiB answer cost the worker about 200 MB of RSS, at 64 about 85
(answer deltas merge into large events, so an entry may be far larger than a token)."""


def _events(entries: Sequence[tuple[str, dict[str, str]]]) -> list[StoredEvent]:
    return [StoredEvent(i, f["event"], f["data"], f["run_id"], f.get("prev")) for i, f in entries]


def _raw_events(entries: Sequence[list[Any]]) -> list[StoredEvent]:
    """Entries of a raw ``XREAD`` reply: ``[id, [field, value, ...]]``."""
    out = []
    for entry_id, fields in entries:
        if len(fields) == 8 and fields[0] == "event" and fields[2] == "data" and fields[6] == "prev":
            # As the writer writes it.
            out.append(StoredEvent(entry_id, fields[1], fields[3], fields[5], fields[7]))
        else:  # an entry of an earlier version (no prev), or fields in another order
            f = dict(zip(fields[::2], fields[1::2], strict=True))
            out.append(StoredEvent(entry_id, f["event"], f["data"], f["run_id"], f.get("prev")))
    return out


def _xadd(key: str, maxlen: tuple[str | int, ...], e: StoredEvent) -> Command:
    if e.prev is None:
        return ("XADD", key, *maxlen, e.id, "event", e.event, "data", e.data, "run_id", e.run_id)
    return ("XADD", key, *maxlen, e.id, "event", e.event, "data", e.data, "run_id", e.run_id, "prev", e.prev)


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


class _Subscription:
    """This process's interest in one conversation's stream: where reading is, and who follows."""

    __slots__ = (
        "conversation_id",
        "followers",
        "key",
        "key_bulk",
        "position",
        "position_bulk",
        "position_key",
    )

    def __init__(self, conversation_id: str, key: str, position: str) -> None:
        self.conversation_id = conversation_id
        self.key = key
        self.key_bulk = bulk(key)
        self._move_to(position)
        self.followers: set[_Follower] = set()

    def _move_to(self, position: str) -> None:
        # Id of the last entry handed to followers; a follower that joins now gets all after it.
        # Kept parsed (to compare) and in RESP form (the reader's XREAD) as well.
        self.position = position
        self.position_key = parse_cursor(position)
        self.position_bulk = bulk(position)

    def deliver(self, events: list[StoredEvent], limit: int) -> None:
        if parse_cursor(events[0].id) <= self.position_key:
            # A reply to a read issued before this subscription was renewed: drop what it had.
            events = [e for e in events if parse_cursor(e.id) > self.position_key]
            if not events:
                return
        self._move_to(events[-1].id)
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

    def fail(self, error: BaseException) -> None:
        for follower in self.followers:
            follower.error = error
            follower.wakeup.set()
        self.followers.clear()


class _StreamReader:
    """The process's one blocking reader: ``XREAD BLOCK`` over every followed stream at once.

    It runs on a connection of its own. When a conversation gets its first follower while the
    reader is blocked on the others, ``CLIENT UNBLOCK`` (sent on the shared pool) makes it return
    at once and read again with the new stream included.
    """

    def __init__(self, bus: RedisEventBus, connection: RespConnection) -> None:
        self.bus = bus
        self.connection = connection
        self.subscriptions: dict[str, _Subscription] = {}
        self._by_key: dict[str, _Subscription] = {}
        self._wake = asyncio.Event()
        self._reading: frozenset[str] | None = None  # keys of the XREAD in flight
        self.unblocking: asyncio.Task[None] | None = None
        # XREAD COUNT <page> BLOCK <ms> STREAMS, the part of the command that does not change.
        self._xread_head = b"".join(
            bulk(str(a)) for a in ("XREAD", "COUNT", _PAGE, "BLOCK", bus.block_ms, "STREAMS")
        )
        # A context of its own: it serves every conversation, not the request that made it (whose
        # run id and span the log lines would otherwise carry).
        self.task = asyncio.create_task(
            self._run(), name="redis-stream-reader", context=contextvars.Context()
        )

    def subscribe(self, conversation_id: str, key: str, position: str) -> _Subscription:
        sub = self.subscriptions.get(conversation_id)
        if sub is None:
            sub = self.subscriptions[conversation_id] = self._by_key[key] = _Subscription(
                conversation_id, key, position
            )
            self._wake.set()
            if self._reading is not None and self.unblocking is None:
                self.unblocking = asyncio.create_task(self._unblock())
        return sub

    def unsubscribe(self, sub: _Subscription, follower: _Follower) -> None:
        sub.followers.discard(follower)
        if not sub.followers and self.subscriptions.get(sub.conversation_id) is sub:
            # The XREAD in flight may still name it; its entries are then ignored.
            del self.subscriptions[sub.conversation_id]
            del self._by_key[sub.key]

    async def _unblock(self) -> None:
        try:
            # The XREAD may still be on its way to Redis (UNBLOCK then finds nothing to unblock):
            # try again shortly until the reader reads every subscribed stream.
            for _ in range(200):
                reading = self._reading
                if reading is None or self._by_key.keys() <= reading:
                    return
                client_id = self.connection.client_id
                if client_id is not None and await self.bus.redis.client_unblock(client_id):
                    return
                await asyncio.sleep(0.002)
        except (RedisError, OSError):
            pass  # the reader will see its own error, or return after block_ms
        finally:
            self.unblocking = None

    async def _run(self) -> None:
        bus = self.bus
        attempt = 0
        while True:
            if not self._by_key:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Packed from each stream's key and position as kept in RESP form: with hundreds of
            # streams followed, packing the whole command anew on every read was the reader's
            # largest cost.
            subs = list(self._by_key.values())
            command = b"".join(
                [
                    array_header(6 + 2 * len(subs)),
                    self._xread_head,
                    *[sub.key_bulk for sub in subs],
                    *[sub.position_bulk for sub in subs],
                ]
            )
            try:
                self._reading = frozenset(self._by_key)
                reply: Any = (await self.connection.execute([command], self._read_timeout_s))[0]
            except asyncio.CancelledError:
                self._fail_all(BusClosedError("the event bus is closed"))
                raise
            except RedisError as exc:
                log.warning("stream reader lost Redis; followers will resync", extra={"error": str(exc)})
                self._fail_all(BusUnavailableError(f"stream reader lost Redis: {exc}"))
                attempt += 1
                await asyncio.sleep(min(1.0, 0.02 * 2.0**attempt))
                continue
            finally:
                self._reading = None
            if isinstance(reply, ResponseError):
                self._fail_all(BusUnavailableError(f"stream reader refused: {reply}"))
                continue
            attempt = 0
            if not reply:
                continue
            limit = bus.follower_buffer
            for key, entries in reply:
                sub = self._by_key.get(key)
                if sub is not None and entries:
                    sub.deliver(_raw_events(entries), limit)

    @property
    def _read_timeout_s(self) -> float:
        return self.bus.block_ms / 1000 + self.connection.timeout_s

    def _fail_all(self, error: BaseException) -> None:
        for sub in self.subscriptions.values():
            sub.fail(error)
        self.subscriptions.clear()
        self._by_key.clear()


class _Writer:
    """Appends of every conversation in this process, sent together: one pipeline per round trip."""

    def __init__(self, bus: RedisEventBus, connection: RespConnection) -> None:
        self.bus = bus
        self.connection = connection
        self._queue: list[tuple[str, Sequence[StoredEvent], asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        # A context of its own: it writes for every run, not for the one whose event started it.
        self.task = asyncio.create_task(
            self._run(), name="redis-stream-writer", context=contextvars.Context()
        )

    def submit(self, key: str, events: Sequence[StoredEvent]) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((key, events, future))
        self._wake.set()
        return future

    async def _run(self) -> None:
        maxlen: tuple[str | int, ...] = ("MAXLEN", "~", self.bus.maxlen) if self.bus.maxlen else ()
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Natural batching: whatever queued up while the previous round trip was in flight.
            batch, self._queue = self._queue, []
            commands: list[Command] = []
            for key, events, _ in batch:
                commands.extend(_xadd(key, maxlen, e) for e in events)
                # A new run must not inherit the expiry the previous run's done set on the stream.
                commands.append(("PERSIST", key))
            try:
                results = await self.connection.execute(commands)
            except asyncio.CancelledError:
                self._fail(batch, BusClosedError("the event bus is closed"))
                self._fail(self._queue, BusClosedError("the event bus is closed"))
                raise
            except RedisError as exc:
                log.warning("stream writer lost Redis", extra={"error": str(exc)})
                self._fail(batch, BusUnavailableError(f"cannot append to Redis: {exc}"))
                continue
            at = 0
            for key, events, future in batch:
                outcome = results[at : at + len(events)]
                at += len(events) + 1
                if not future.done():
                    error = _append_error(key, events, outcome)
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)

    @staticmethod
    def _fail(batch: list[tuple[str, Sequence[StoredEvent], asyncio.Future[None]]], error: Exception) -> None:
        for _, _, future in batch:
            if not future.done():
                future.set_exception(error)


def _append_error(key: str, events: Sequence[StoredEvent], results: list[Any]) -> Exception | None:
    for event, result in zip(events, results, strict=False):
        if isinstance(result, ResponseError):
            if "equal or smaller" in str(result):
                return EventOrderError(
                    f"Redis rejected event id {event.id} for {key}: not greater than the newest id held"
                )
            return BusUnavailableError(f"cannot append to {key}: {result}")
    return None


class RedisEventBus:
    """``EventBus`` on Redis Streams (``{prefix}:events:{conversation_id}``).

    ``maxlen`` caps a stream approximately (older entries are then served from the database);
    ``follower_buffer`` bounds, in events, what one follower may have pending before it is sent
    back to catch up by id; ``reconnect_s`` is how long ``follow()`` retries an unreachable Redis
    before it raises ``BusUnavailableError``; ``client_name`` names its connections in
    ``CLIENT LIST``; ``pool_size`` caps the connections for replays and probes (callers wait for a
    free one), so the process holds at most ``pool_size + 2`` connections however many clients.
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
        pool_size: int = 16,
    ) -> None:
        self.prefix = prefix
        self.maxlen = maxlen
        self.block_ms = block_ms
        self.follower_buffer = follower_buffer
        self.reconnect_s = reconnect_s
        # Replays, probes and expiry go through redis-py. No hidden retries: callers own the retry
        # policy (follow() re-checks for lost entries after an outage). A bounded pool that waits
        # for a free connection, so a burst of reconnecting clients cannot open hundreds.
        self.redis: Redis = Redis.from_pool(
            BlockingConnectionPool.from_url(
                url,
                max_connections=pool_size,
                timeout=socket_timeout_s,
                decode_responses=True,
                protocol=2,
                retry=Retry(NoBackoff(), 0),
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                client_name=client_name,
            )
        )
        # The hot paths each own a bare connection: the blocking reader (which holds it for up to
        # block_ms at a time, so it never starves anyone) and the writer.
        self._reader_connection = RespConnection(url, client_name=client_name, timeout_s=socket_timeout_s)
        self._writer_connection = RespConnection(url, client_name=client_name, timeout_s=socket_timeout_s)
        self._reader: _StreamReader | None = None
        self._writer: _Writer | None = None
        self._closed = False

    def stream_key(self, conversation_id: str) -> str:
        return f"{self.prefix}:events:{conversation_id}"

    # ---- writing ---------------------------------------------------------------------------

    async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        self._check_open()
        if not events:
            return
        if self._writer is None:
            self._writer = _Writer(self, self._writer_connection)
        await self._writer.submit(self.stream_key(conversation_id), events)

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
            sub: _Subscription | None = None
            try:
                if verify:
                    # Back after an outage or a fall-behind: only go on if the stream still holds what
                    # we had (Redis may have restarted empty, or trimmed): else entries may be lost.
                    if not await self._still_holds(conversation_id, last_key):
                        raise _StreamLostError(f"stream of {conversation_id} no longer holds {last}")
                    verify = False
                # Replay what the stream holds, then subscribe and dedupe by id across the seam.
                while True:
                    batch = await self.read_after(conversation_id, last, _FOLLOWER_PAGE)
                    for event in batch:
                        yield event
                    if batch:
                        last = batch[-1].id
                        last_key = parse_cursor(last)
                    if len(batch) < _FOLLOWER_PAGE:
                        break
                self._check_open()
                if self._reader is None:
                    self._reader = _StreamReader(self, self._reader_connection)
                reader = self._reader
                sub = reader.subscribe(conversation_id, self.stream_key(conversation_id), last)
                registered_at = sub.position
                sub.followers.add(follower)
                # Entries the reader handed out before we joined were appended after our replay.
                while parse_cursor(registered_at) > last_key:
                    batch = await self._read_range(conversation_id, last, registered_at, _FOLLOWER_PAGE)
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
                        if parse_cursor(batch[0].id) <= last_key:
                            # Only right after joining can a batch overlap what was replayed.
                            batch = [e for e in batch if parse_cursor(e.id) > last_key]
                            if not batch:
                                continue
                        for event in batch:
                            yield event
                        last = batch[-1].id
                        last_key = parse_cursor(last)
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
                if reader is not None and sub is not None:
                    reader.unsubscribe(sub, follower)

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
        tasks = [part.task for part in (self._reader, self._writer) if part is not None]
        if self._reader is not None and self._reader.unblocking is not None:
            tasks.append(self._reader.unblocking)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.redis.aclose()
        await self._reader_connection.aclose()
        await self._writer_connection.aclose()

    @property
    def subscriptions(self) -> dict[str, _Subscription]:
        """Followed conversations of this process (for tests and metrics)."""
        return self._reader.subscriptions if self._reader is not None else {}

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
