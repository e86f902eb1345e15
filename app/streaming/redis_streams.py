"""What the two Redis Streams buses share: reads by id, and ``follow()`` over a shared reader.

``RedisEventBus`` (one Redis, ``app.streaming.redis_bus``) and ``RedisClusterEventBus`` (a Redis
Cluster, ``app.streaming.redis_cluster_bus``) keep one stream per conversation and differ in how
they write and how their one reader per process learns of new entries. Both fan entries out to a
conversation's local followers through a ``Subscription``, each follower holding a bounded buffer
(``Follower``); a follower that falls too far behind loses its buffer and catches up from the stream
by id (``XRANGE``), so a slow client never stalls the others nor grows memory.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

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
from app.streaming.redis_keys import RedisKeys
from app.streaming.redis_wire import Command, bulk

log = logging.getLogger("app.streaming.redis")

PAGE = 1000
"""Entries a reader reads of one stream at a time."""
FOLLOWER_PAGE = 64
"""Entries one follower reads for itself at a time (replay, catch-up). A follower whose client
stopped reading holds its page until the client goes, so the page is small: at 1000 entries, 40
clients that stopped reading an 8 MiB answer cost the worker about 200 MB of RSS, at 64 about 85
(answer deltas merge into large events, so an entry may be far larger than a token)."""


LINGER_S = 0.001
"""After a small round (a read or a write of fewer than ``LINGER_BELOW`` entries), the reader and
the writer wait this long before the next, so that under a steady load of slow tokens one round
trip carries many of them instead of one each (a round trip, and its reply's parsing, cost far
more than an entry). An entry that comes meanwhile waits at most this long; one that comes to an
idle reader or writer does not wait at all."""
LINGER_BELOW = 32


LOCAL_FEED_S = 1.0
"""How long after this process last handed a conversation's own appends to its followers
(``Subscription.feed``) the reader leaves that stream out of its reads. Only another process's
append could come meanwhile, and only when two attempts of a run overlap (a lease lost while its
worker still runs): the reader reads it once this lapses, or at once when the next append here
shows it (``APPEND_SCRIPT``'s answer)."""

_HANDS_BACK = frozenset({"done", "phase"})

APPEND_SCRIPT = """
local key = KEYS[1]
local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
local before = ''
if top[1] then before = top[1][1] end
local maxlen = tonumber(ARGV[1])
for i = 2, #ARGV, 5 do
  local fields = {'event', ARGV[i + 1], 'data', ARGV[i + 2], 'run_id', ARGV[i + 3]}
  if ARGV[i + 4] ~= '' then
    fields[7] = 'prev'
    fields[8] = ARGV[i + 4]
  end
  if maxlen > 0 then
    redis.call('XADD', key, 'MAXLEN', '~', maxlen, ARGV[i], unpack(fields))
  else
    redis.call('XADD', key, ARGV[i], unpack(fields))
  end
end
redis.call('PERSIST', key)
return before
"""
"""One conversation's appends at once: KEYS[1] the stream, ARGV[1] its MAXLEN (0: none), then per
entry its id, event, data, run_id and prev ('' when none). The entries are added in order (the
first refused one, an id not above the stream's newest, ends the script with Redis's error), the
expiry a previous run's done set is removed, and the answer is the id of the stream's newest entry
before them ('' if none): equal to the first entry's ``prev``, nobody else appended in between."""
APPEND_SHA = hashlib.sha1(APPEND_SCRIPT.encode()).hexdigest()


def append_command(key: str, maxlen: int | None, events: Sequence[StoredEvent], *, by_sha: bool) -> Command:
    """``APPEND_SCRIPT`` on ``events`` (``EVALSHA``, or ``EVAL`` with the script itself)."""
    args: list[str | int] = ["EVALSHA" if by_sha else "EVAL", APPEND_SHA if by_sha else APPEND_SCRIPT, 1, key]
    args.append(maxlen or 0)
    for e in events:
        args += (e.id, e.event, e.data, e.run_id, e.prev or "")
    return tuple(args)


def stored_events(entries: Sequence[tuple[str, dict[str, str]]]) -> list[StoredEvent]:
    """Entries as redis-py returns them (``XRANGE``, ``XREAD``): ``(id, {field: value})``."""
    return [StoredEvent(i, f["event"], f["data"], f["run_id"], f.get("prev")) for i, f in entries]


def xadd_command(key: str, maxlen: tuple[str | int, ...], e: StoredEvent) -> Command:
    if e.prev is None:
        return ("XADD", key, *maxlen, e.id, "event", e.event, "data", e.data, "run_id", e.run_id)
    return ("XADD", key, *maxlen, e.id, "event", e.event, "data", e.data, "run_id", e.run_id, "prev", e.prev)


def append_error(key: str, events: Sequence[StoredEvent], results: Sequence[Any]) -> Exception | None:
    """The error of an append, from the replies to its ``XADD`` commands; None if it succeeded."""
    for event, result in zip(events, results, strict=False):
        if isinstance(result, ResponseError):
            if "equal or smaller" in str(result):
                return EventOrderError(
                    f"Redis rejected event id {event.id} for {key}: not greater than the newest id held"
                )
            return BusUnavailableError(f"cannot append to {key}: {result}")
        if isinstance(result, BaseException):
            return BusUnavailableError(f"cannot append to {key}: {result}")
    return None


Append = tuple[str, Sequence[StoredEvent]]
"""One ``append()``: the conversation id and its events."""


class StreamWriter:
    """Appends of every conversation in this process, sent together: one round trip per batch
    (whatever queued up while the previous one was in flight). Subclasses say how a batch goes."""

    unreachable: ClassVar[tuple[type[BaseException], ...]] = (RedisError,)
    """Errors of a whole round trip (every append of the batch may or may not have been made)."""

    def __init__(self, maxlen: int | None, name: str) -> None:
        self.maxlen: tuple[str | int, ...] = ("MAXLEN", "~", maxlen) if maxlen else ()
        self._queue: list[tuple[str, Sequence[StoredEvent], asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        # A context of its own: it writes for every run, not for the one whose event started it.
        self.task = asyncio.create_task(self._run(), name=name, context=contextvars.Context())

    def submit(self, conversation_id: str, events: Sequence[StoredEvent]) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((conversation_id, events, future))
        self._wake.set()
        return future

    async def _write(self, batch: list[Append]) -> list[Exception | None]:
        """Send ``batch`` in one round trip; each append's error (None: appended)."""
        raise NotImplementedError

    async def _run(self) -> None:
        batch: list[tuple[str, Sequence[StoredEvent], asyncio.Future[None]]] = []
        try:
            while True:
                if not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch, self._queue = self._queue, []
                try:
                    errors = await self._write(
                        [(conversation_id, events) for conversation_id, events, _ in batch]
                    )
                except self.unreachable as exc:
                    log.warning("stream writer lost Redis", extra={"error": str(exc)})
                    self._fail(batch, BusUnavailableError(f"cannot append to Redis: {exc}"))
                    continue
                for (_, _, future), error in zip(batch, errors, strict=True):
                    if not future.done():
                        if error is None:
                            future.set_result(None)
                        else:
                            future.set_exception(error)
                if len(batch) < LINGER_BELOW:
                    await asyncio.sleep(LINGER_S)
        except asyncio.CancelledError:
            self._fail(batch, BusClosedError("the event bus is closed"))
            self._fail(self._queue, BusClosedError("the event bus is closed"))
            raise

    @staticmethod
    def _fail(batch: list[tuple[str, Sequence[StoredEvent], asyncio.Future[None]]], error: Exception) -> None:
        for _, _, future in batch:
            if not future.done():
                future.set_exception(error)


class Follower:
    """One ``follow()`` call's share of a reader: batches not yet yielded, at most ``limit`` events."""

    __slots__ = ("batches", "error", "overflowed", "size", "wakeup")

    def __init__(self) -> None:
        self.batches: deque[list[StoredEvent]] = deque()
        self.size = 0
        self.overflowed = False
        self.error: BaseException | None = None
        self.wakeup = asyncio.Event()


class Subscription:
    """This process's interest in one conversation's stream: where reading is, and who follows.

    Entries reach the followers from the process's reader, or, for the appends of this process
    itself, straight from its writer (``feed``), which spares the reader reading them back.
    """

    __slots__ = (
        "_position_bulk",
        "conversation_id",
        "fed_until",
        "followers",
        "key",
        "key_bulk",
        "position",
        "position_key",
    )

    def __init__(self, conversation_id: str, key: str, position: str) -> None:
        self.conversation_id = conversation_id
        self.key = key
        self.key_bulk = bulk(key)
        self._move_to(position)
        self.followers: set[Follower] = set()
        self.fed_until = 0.0
        """Until when (the loop's clock) the reader leaves this stream to ``feed``."""

    def _move_to(self, position: str) -> None:
        # Id of the last entry handed to followers; a follower that joins now gets all after it.
        # Kept parsed (to compare) as well.
        self.position = position
        self.position_key = parse_cursor(position)
        self._position_bulk: bytes | None = None

    @property
    def position_bulk(self) -> bytes:
        """``position`` in RESP form, for the single-node reader's ``XREAD`` (made when it reads:
        not on every feed of a stream the reader leaves out)."""
        if self._position_bulk is None:
            self._position_bulk = bulk(self.position)
        return self._position_bulk

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

    def feed(self, events: list[StoredEvent], before: str, limit: int, now: float) -> bool:
        """Hand the followers this process's own append of ``events``, after which the stream's
        newest entry was ``before`` (``APPEND_SCRIPT``; '' if none), and leave the stream out of
        the reader's reads for ``LOCAL_FEED_S``. Only when nothing can lie between what the
        followers have and ``events``: ``events`` come right after ``before`` (their ``prev``), and
        the followers have everything up to it (the reader, blocked on this stream, may even have
        handed them some of ``events`` already: ``deliver`` drops what they have). Otherwise
        (another process appended in between, or the reader is behind) the reader delivers them,
        and False says it must read this stream now."""
        first = events[0].prev or ""
        if first != before or (before and parse_cursor(before) > self.position_key):
            self.fed_until = 0.0
            return False
        self.deliver(events, limit)
        # After a run's done, or a phase (a run that parks, for one), what comes next may be
        # another worker's: back to the reader.
        self.fed_until = 0.0 if events[-1].event in _HANDS_BACK else now + LOCAL_FEED_S
        return True

    def fail(self, error: BaseException) -> None:
        for follower in self.followers:
            follower.error = error
            follower.wakeup.set()
        self.followers.clear()


class StreamReader(Protocol):
    """A process's one reader of followed streams, handing new entries to their subscriptions."""

    subscriptions: dict[str, Subscription]

    def subscribe(self, conversation_id: str, key: str, position: str) -> Subscription: ...

    def unsubscribe(self, sub: Subscription, follower: Follower) -> None: ...


ReaderT = TypeVar("ReaderT", bound=StreamReader)


class _StreamLostError(Exception):
    """Internal: the stream no longer vouches for continuity; surfaced as ``BusUnavailableError``."""


class RedisStreamsBus(Generic[ReaderT]):
    """The reading half of an ``EventBus`` on Redis Streams; subclasses write and run the reader.

    ``redis`` is a redis-py client (``Redis`` or ``RedisCluster``, ``decode_responses=True``)
    making no retries of its own: callers own the retry policy (``follow()`` re-checks for lost
    entries after an outage, the publisher re-appends what is missing).
    """

    unreachable: ClassVar[tuple[type[BaseException], ...]] = (
        RedisConnectionError,
        RedisTimeoutError,
        OSError,
    )
    """Errors that mean Redis cannot be reached (``BusUnavailableError``)."""

    def __init__(self, redis: Any, keys: RedisKeys, *, follower_buffer: int, reconnect_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.prefix = keys.prefix
        self.follower_buffer = follower_buffer
        self.reconnect_s = reconnect_s
        self._reader: ReaderT | None = None
        self._writer: StreamWriter | None = None
        self._closed = False

    def stream_key(self, conversation_id: str) -> str:
        return self.keys.events(conversation_id)

    def _start_reader(self) -> ReaderT:
        """The process's reader, started (on first use)."""
        raise NotImplementedError

    def _stream_reader(self) -> ReaderT:
        if self._reader is None:
            self._reader = self._start_reader()
        return self._reader

    def _start_writer(self) -> StreamWriter:
        """The process's stream writer, started (on first use)."""
        raise NotImplementedError

    async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
        if events:
            await self.append_nowait(conversation_id, events)
        else:
            self._check_open()

    def append_nowait(self, conversation_id: str, events: Sequence[StoredEvent]) -> asyncio.Future[None]:
        """``append`` without waiting: the future ends as ``append`` would (``RunPublisher``'s
        direct sends). Raises ``BusClosedError`` at once if the bus is closed."""
        self._check_open()
        if self._writer is None:
            self._writer = self._start_writer()
        return self._writer.submit(conversation_id, events)

    # ---- writing by key --------------------------------------------------------------------

    async def expire(self, conversation_id: str, seconds: int) -> None:
        await self._call(self.redis.expire, self.stream_key(conversation_id), max(1, int(seconds)))

    async def delete(self, conversation_id: str) -> None:
        await self._call(self.redis.delete, self.stream_key(conversation_id))

    # ---- reading ---------------------------------------------------------------------------

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[StoredEvent]:
        return await self._read_range(conversation_id, after, "+", limit)

    async def _read_range(self, conversation_id: str, after: str, upto: str, limit: int) -> list[StoredEvent]:
        key = self.stream_key(conversation_id)
        return stored_events(await self._call(self.redis.xrange, key, f"({after}", upto, limit))

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
            follower = Follower()
            reader: StreamReader | None = None
            sub: Subscription | None = None
            try:
                if verify:
                    # Back after an outage or a fall-behind: only go on if the stream still holds what
                    # we had (Redis may have restarted empty, or trimmed): else entries may be lost.
                    if not await self._still_holds(conversation_id, last_key):
                        raise _StreamLostError(f"stream of {conversation_id} no longer holds {last}")
                    verify = False
                # Replay what the stream holds, then subscribe and dedupe by id across the seam.
                while True:
                    batch = await self.read_after(conversation_id, last, FOLLOWER_PAGE)
                    for event in batch:
                        yield event
                    if batch:
                        last = batch[-1].id
                        last_key = parse_cursor(last)
                    if len(batch) < FOLLOWER_PAGE:
                        break
                self._check_open()
                reader = self._stream_reader()
                sub = reader.subscribe(conversation_id, self.stream_key(conversation_id), last)
                registered_at = sub.position
                sub.followers.add(follower)
                # Entries the reader handed out before we joined were appended after our replay.
                while parse_cursor(registered_at) > last_key:
                    batch = await self._read_range(conversation_id, last, registered_at, FOLLOWER_PAGE)
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

    @property
    def subscriptions(self) -> dict[str, Subscription]:
        """Followed conversations of this process (for tests and metrics)."""
        return self._reader.subscriptions if self._reader is not None else {}

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosedError("the event bus is closed")

    async def _call(self, method: Any, *args: Any) -> Any:
        self._check_open()
        try:
            return await method(*args)
        except self.unreachable as exc:
            raise BusUnavailableError(f"Redis unreachable: {exc}") from exc
        except ResponseError as exc:
            raise BusUnavailableError(f"Redis refused: {exc}") from exc
