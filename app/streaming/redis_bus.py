"""``RedisEventBus``: the event bus shared by every worker, one Redis Stream per conversation.

Writes carry the ids the publisher assigned. Appends of all conversations of a process go out
together, one pipelined round trip per batch (what queued up while the previous one was in
flight), so the cost per event is a few microseconds of packing, not a round trip.

Reads for live delivery are shared too: the process runs ONE reader task with ONE blocking
connection, ``XREAD BLOCK`` over every stream that has local followers, and fans entries out to
each conversation's followers through bounded per-follower buffers. No Redis connection per SSE
client, nor per conversation. A follower that falls too far behind loses its buffer and catches up
from the stream by id (``XRANGE``), so a slow client never stalls the others nor grows memory.

What this process appends itself reaches its own followers without that round trip: each append
(``APPEND_SCRIPT``) answers the stream's newest id before it, so the writer knows when nothing
else lies between the followers' position and its entries, and hands them over at once
(``Subscription.feed``); the reader leaves such a stream out of its reads meanwhile. At a few
hundred streaming runs, reading back a worker's own appends (an ``XREAD`` naming every followed
stream, up to a thousand times a second) was about a sixth of its CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from app.streaming.bus import BusClosedError, BusUnavailableError, StoredEvent
from app.streaming.redis_keys import RedisKeys
from app.streaming.redis_streams import (
    LINGER_BELOW,
    LINGER_S,
    PAGE,
    Append,
    Follower,
    RedisStreamsBus,
    StreamWriter,
    Subscription,
    append_command,
    append_error,
)
from app.streaming.redis_wire import Command, RespConnection, array_header, bulk

log = logging.getLogger("app.streaming.redis")


def _no_script(reply: ResponseError) -> bool:
    return str(reply).startswith("NOSCRIPT")


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


class _StreamReader:
    """The process's one blocking reader: ``XREAD BLOCK`` over every followed stream at once.

    It runs on a connection of its own. When a conversation gets its first follower while the
    reader is blocked on the others, ``CLIENT UNBLOCK`` (sent on the shared pool) makes it return
    at once and read again with the new stream included.
    """

    def __init__(self, bus: RedisEventBus, connection: RespConnection) -> None:
        self.bus = bus
        self.connection = connection
        self.subscriptions: dict[str, Subscription] = {}
        self._by_key: dict[str, Subscription] = {}
        self._wake = asyncio.Event()
        self._reading: frozenset[str] | None = None  # keys of the XREAD in flight
        self.unblocking: asyncio.Task[None] | None = None
        # XREAD COUNT <page> BLOCK <ms> STREAMS, the part of the command that does not change.
        self._xread_head = b"".join(
            bulk(str(a)) for a in ("XREAD", "COUNT", PAGE, "BLOCK", bus.block_ms, "STREAMS")
        )
        # A context of its own: it serves every conversation, not the request that made it (whose
        # run id and span the log lines would otherwise carry).
        self.task = asyncio.create_task(
            self._run(), name="redis-stream-reader", context=contextvars.Context()
        )

    def subscribe(self, conversation_id: str, key: str, position: str) -> Subscription:
        sub = self.subscriptions.get(conversation_id)
        if sub is None:
            sub = self.subscriptions[conversation_id] = self._by_key[key] = Subscription(
                conversation_id, key, position
            )
            self._want()
        return sub

    def _want(self) -> None:
        """A stream is to be read that the read in flight (if any) leaves out: read again now."""
        self._wake.set()
        if self._reading is not None and self.unblocking is None:
            self.unblocking = asyncio.create_task(self._unblock())

    def appended_here(self, conversation_id: str, events: list[StoredEvent], before: str) -> None:
        """This process appended ``events`` to the conversation's stream, whose newest entry was
        ``before`` until then: its followers get them now if nothing can lie in between."""
        sub = self.subscriptions.get(conversation_id)
        if sub is not None and sub.followers:
            now = asyncio.get_running_loop().time()
            if not sub.feed(events, before, self.bus.follower_buffer, now) and sub.key not in (
                self._reading or ()
            ):
                self._want()

    def _to_read(self, now: float) -> list[Subscription]:
        """The followed streams the reader reads now: those no append of this process fed lately."""
        return [sub for sub in self._by_key.values() if sub.fed_until <= now]

    def unsubscribe(self, sub: Subscription, follower: Follower) -> None:
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
                now = asyncio.get_running_loop().time()
                if reading is None or all(sub.key in reading for sub in self._to_read(now)):
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
        try:
            await self._read_forever()
        except asyncio.CancelledError:
            # Closed: whether in a read or between two, every follower learns it.
            self._fail_all(BusClosedError("the event bus is closed"))
            raise

    async def _read_forever(self) -> None:
        bus = self.bus
        attempt = 0
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            subs = self._to_read(now)
            if not subs:
                # Nothing to read: wait for a new follower, a stream to read again, or the first
                # feed to lapse.
                self._wake.clear()
                lapse = min((sub.fed_until for sub in self._by_key.values()), default=None)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(None if lapse is None else max(0.0, lapse - now)):
                        await self._wake.wait()
                continue
            # Packed from each stream's key and position as kept in RESP form: with hundreds of
            # streams followed, packing the whole command anew on every read was the reader's
            # largest cost.
            command = b"".join(
                [
                    array_header(6 + 2 * len(subs)),
                    self._xread_head,
                    *[sub.key_bulk for sub in subs],
                    *[sub.position_bulk for sub in subs],
                ]
            )
            try:
                self._reading = frozenset(sub.key for sub in subs)
                reply: Any = (await self.connection.execute([command], self._read_timeout_s))[0]
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
            read = 0
            for key, entries in reply:
                sub = self._by_key.get(key)
                if sub is not None and entries:
                    sub.deliver(_raw_events(entries), limit)
                    read += len(entries)
            if read < LINGER_BELOW:
                await asyncio.sleep(LINGER_S)

    @property
    def _read_timeout_s(self) -> float:
        return self.bus.block_ms / 1000 + self.connection.timeout_s

    def _fail_all(self, error: BaseException) -> None:
        for sub in self.subscriptions.values():
            sub.fail(error)
        self.subscriptions.clear()
        self._by_key.clear()


class _Writer(StreamWriter):
    """The appends of a batch as one pipeline on the writer's own connection."""

    def __init__(self, bus: RedisEventBus, connection: RespConnection) -> None:
        self.bus = bus
        self.connection = connection
        super().__init__(bus.maxlen, "redis-stream-writer")

    async def _write(self, batch: list[Append]) -> list[Exception | None]:
        bus = self.bus
        keys = [bus.stream_key(conversation_id) for conversation_id, _ in batch]
        # One script call per conversation (APPEND_SCRIPT): its entries, and the removal of the
        # expiry the previous run's done set on the stream (a new run must not inherit it).
        commands: list[Command] = [
            append_command(key, bus.maxlen, events, by_sha=True)
            for key, (_, events) in zip(keys, batch, strict=True)
        ]
        results = await self.connection.execute(commands)
        unknown = [i for i, r in enumerate(results) if isinstance(r, ResponseError) and _no_script(r)]
        if unknown:  # Redis restarted, or its scripts were flushed: the script itself, once
            again = await self.connection.execute(
                [append_command(keys[i], bus.maxlen, batch[i][1], by_sha=False) for i in unknown]
            )
            for i, result in zip(unknown, again, strict=True):
                results[i] = result
        errors: list[Exception | None] = []
        reader = bus._reader
        for key, (conversation_id, events), result in zip(keys, batch, results, strict=True):
            error = append_error(key, events, [result])
            errors.append(error)
            if error is None and reader is not None and isinstance(result, str):
                reader.appended_here(conversation_id, list(events), result)
        return errors


class RedisEventBus(RedisStreamsBus["_StreamReader"]):
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
        self.maxlen = maxlen
        self.block_ms = block_ms
        # Replays, probes and expiry go through redis-py. No hidden retries: callers own the retry
        # policy (follow() re-checks for lost entries after an outage). A bounded pool that waits
        # for a free connection, so a burst of reconnecting clients cannot open hundreds.
        redis: Redis = Redis.from_pool(
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
        super().__init__(redis, RedisKeys(prefix), follower_buffer=follower_buffer, reconnect_s=reconnect_s)
        # The hot paths each own a bare connection: the blocking reader (which holds it for up to
        # block_ms at a time, so it never starves anyone) and the writer.
        self._reader_connection = RespConnection(url, client_name=client_name, timeout_s=socket_timeout_s)
        self._writer_connection = RespConnection(url, client_name=client_name, timeout_s=socket_timeout_s)

    # ---- writing ---------------------------------------------------------------------------

    def _start_writer(self) -> StreamWriter:
        return _Writer(self, self._writer_connection)

    def _start_reader(self) -> _StreamReader:
        return _StreamReader(self, self._reader_connection)

    # ---- service ---------------------------------------------------------------------------

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
