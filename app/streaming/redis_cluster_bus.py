"""``RedisClusterEventBus``: the event bus on a Redis Cluster (RUNS.md S-01), one stream per conversation.

A cluster refuses a command over keys of different slots (``CROSSSLOT``), even on one node, so the
single-node design (one ``XREAD BLOCK`` over every followed stream) cannot work here. Instead:

- Writing: the appends of every conversation of the process that queued up while the previous
  round trip was in flight go out in one cluster pipeline (redis-py sends one pipeline per master).
  Each conversation's ``XADD``s are followed, on the same connection, by a ``SPUBLISH`` on its
  sharded wake channel (``{prefix}:wake:{<conversation_id>}``, the same slot as its stream).
- Reading: per master, one connection subscribed (``SSUBSCRIBE``) to the wake channels of the
  conversations followed in this process (``_ShardListener``). A wake marks the conversation to
  read; the one reader task reads every marked stream from its position in one pipeline of
  single-key ``XREAD``s, and fans the entries out to the followers as on one Redis.
- Nothing is missed while a subscription was not in place: every (re)subscribe, once Redis
  confirms it, reads the stream once; a sweep every ``sweep_s`` reads every followed stream (a
  guard against lost notifications). A master that fails over, a slot that moves (``MOVED``, a
  server-side ``sunsubscribe``) refreshes the slot map and moves the subscriptions to their new
  masters. Reads that fail end the followers' wait with ``BusUnavailableError``; they re-check that
  the stream still holds their position and go on, or leave the gap to the database
  (``app.streaming.resume``), as on one Redis.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
from collections.abc import Sequence
from typing import Any, ClassVar

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.streaming.bus import BusClosedError, BusUnavailableError
from app.streaming.redis_keys import RedisKeys
from app.streaming.redis_streams import (
    PAGE,
    Append,
    Follower,
    RedisStreamsBus,
    StreamWriter,
    Subscription,
    append_error,
    stored_events,
    xadd_command,
)
from app.streaming.redis_wire import Command, RespConnection

log = logging.getLogger("app.streaming.redis_cluster")

_CLUSTER_ERRORS = (RedisError, RedisClusterException, OSError)
"""What a cluster command may raise when a node is away or the slot map is changing."""


def _backoff(attempt: int, cap: float = 1.0) -> float:
    return min(cap, 0.02 * 2.0**attempt) * (0.5 + random.random() / 2)


class _ShardListener:
    """One master's connection subscribed to the wake channels of the streams it serves.

    It reconnects by itself; after every (re)subscribe Redis confirms, the reader reads that
    conversation's stream once. ``MOVED`` replies, a ``sunsubscribe`` Redis sends because a slot
    moved, and a lost connection ask the reader to refresh the slot map.
    """

    def __init__(self, reader: _ClusterStreamReader, name: str, address: tuple[str, int]) -> None:
        bus = reader.bus
        self.reader = reader
        self.name = name
        self.channels: dict[str, str] = {}
        """Wake channel -> conversation id, of the conversations this master should wake."""
        self._connection = RespConnection(
            bus.url, client_name=bus.client_name, timeout_s=bus.socket_timeout_s, address=address
        )
        self._live = False  # connected, and every channel of ``channels`` sent to Redis
        self.task = asyncio.create_task(
            self._run(), name=f"redis-shard-listener-{name}", context=contextvars.Context()
        )

    def add(self, channel: str, conversation_id: str) -> None:
        self.channels[channel] = conversation_id
        self._send(("SSUBSCRIBE", channel))

    def remove(self, channel: str) -> None:
        if self.channels.pop(channel, None) is not None:
            self._send(("SUNSUBSCRIBE", channel))

    def _send(self, command: Command) -> None:
        if not self._live:
            return  # sent with the others once (re)connected
        try:
            self._connection.send([command])
        except RedisError:
            self._live = False  # the listener's own read sees the lost connection

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._connection.connect()
                # A channel (S)SUBSCRIBE each: a command's channels must share one slot.
                self._connection.send([("SSUBSCRIBE", channel) for channel in self.channels])
                self._live = True
                attempt = 0
                while True:
                    message = await self._connection.receive(self.reader.bus.sweep_s)
                    if message is not None:
                        self._on_message(message)
            except RedisError as exc:
                self._live = False
                self._connection.close()
                if attempt == 0:  # once an outage, not once a retry
                    log.warning(
                        "wake listener lost its master; refreshing the slot map",
                        extra={"node": self.name, "error": str(exc)},
                    )
                self.reader.refresh_topology()
                attempt += 1
                await asyncio.sleep(_backoff(attempt))

    def _on_message(self, message: Any) -> None:
        if isinstance(message, ResponseError):
            # MOVED: this master no longer serves a channel's slot (failover, resharding).
            self.reader.refresh_topology()
            return
        if not isinstance(message, list) or len(message) != 3:
            return
        kind, channel, _ = message
        conversation_id = self.channels.get(channel)
        if conversation_id is None:
            return
        if kind in ("smessage", "ssubscribe"):
            # An append, or a (re)subscribe: whatever came before it is read now.
            self.reader.mark(conversation_id)
        elif kind == "sunsubscribe":
            self.reader.refresh_topology()  # Redis dropped a channel we still want: its slot moved

    async def aclose(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        await self._connection.aclose()


class _ClusterStreamReader:
    """The process's one reader of followed streams on a cluster: reads the streams a wake, a
    (re)subscribe or the sweep marked, in one pipeline per round."""

    def __init__(self, bus: RedisClusterEventBus) -> None:
        self.bus = bus
        self.subscriptions: dict[str, Subscription] = {}
        self._marked: set[str] = set()
        self._wake = asyncio.Event()
        self._listeners: dict[str, _ShardListener] = {}  # by node name
        self._listener_of: dict[str, _ShardListener] = {}  # by conversation id
        self._refresh = asyncio.Event()
        # Contexts of their own: they serve every conversation, not the request that made them.
        self.task = asyncio.create_task(
            self._read_loop(), name="redis-cluster-reader", context=contextvars.Context()
        )
        self.topology_task = asyncio.create_task(
            self._topology_loop(), name="redis-cluster-topology", context=contextvars.Context()
        )

    # ---- followers come and go -------------------------------------------------------------

    def subscribe(self, conversation_id: str, key: str, position: str) -> Subscription:
        sub = self.subscriptions.get(conversation_id)
        if sub is None:
            sub = self.subscriptions[conversation_id] = Subscription(conversation_id, key, position)
            self._assign(conversation_id)
        return sub

    def unsubscribe(self, sub: Subscription, follower: Follower) -> None:
        sub.followers.discard(follower)
        if not sub.followers and self.subscriptions.get(sub.conversation_id) is sub:
            self._drop(sub.conversation_id)

    def _drop(self, conversation_id: str) -> None:
        del self.subscriptions[conversation_id]
        self._marked.discard(conversation_id)
        listener = self._listener_of.pop(conversation_id, None)
        if listener is not None:
            listener.remove(self.bus.keys.wake(conversation_id))

    def _assign(self, conversation_id: str) -> None:
        """Subscribe to the conversation's wake channel on the master serving its slot now."""
        channel = self.bus.keys.wake(conversation_id)
        try:
            node = self.bus.redis.get_node_from_key(channel)
        except _CLUSTER_ERRORS:
            node = None
        if node is None:
            self.refresh_topology()  # assigned once the slot map is whole again
            return
        listener = self._listeners.get(node.name)
        if listener is None:
            listener = self._listeners[node.name] = _ShardListener(self, node.name, (node.host, node.port))
        listener.add(channel, conversation_id)
        self._listener_of[conversation_id] = listener

    # ---- reading ---------------------------------------------------------------------------

    def mark(self, conversation_id: str) -> None:
        """Read the conversation's stream from its position at the next round."""
        if conversation_id in self.subscriptions:
            self._marked.add(conversation_id)
            self._wake.set()

    def refresh_topology(self) -> None:
        self._refresh.set()

    async def _read_loop(self) -> None:
        attempt = 0
        while True:
            if not self._marked:
                self._wake.clear()
                await self._wake.wait()
                continue
            subs = [self.subscriptions[c] for c in self._marked if c in self.subscriptions]
            self._marked.clear()
            pipe = self.bus.redis.pipeline()
            for sub in subs:
                pipe.xread({sub.key: sub.position}, count=PAGE)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except asyncio.CancelledError:
                self._fail_all(BusClosedError("the event bus is closed"))
                raise
            except _CLUSTER_ERRORS as exc:
                log.warning("stream reader lost a master; followers will resync", extra={"error": str(exc)})
                self._fail(subs, BusUnavailableError(f"stream reader lost Redis: {exc}"))
                self.refresh_topology()
                attempt += 1
                await asyncio.sleep(_backoff(attempt))
                continue
            attempt = 0
            failed = []
            for sub, reply in zip(subs, replies, strict=True):
                if isinstance(reply, BaseException):
                    failed.append(sub)
                    continue
                entries = reply[0][1] if reply else []
                if entries and self.subscriptions.get(sub.conversation_id) is sub:
                    sub.deliver(stored_events(entries), self.bus.follower_buffer)
                    if len(entries) == PAGE:
                        self.mark(sub.conversation_id)  # more to read
            if failed:
                self._fail(failed, BusUnavailableError("stream reader could not read from a master"))
                self.refresh_topology()

    def _fail(self, subs: Sequence[Subscription], error: BaseException) -> None:
        for sub in subs:
            sub.fail(error)
            if self.subscriptions.get(sub.conversation_id) is sub:
                self._drop(sub.conversation_id)

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self.subscriptions.values()), error)

    # ---- the slot map, and the sweep -------------------------------------------------------

    async def _topology_loop(self) -> None:
        attempt = 0
        while True:
            try:
                async with asyncio.timeout(self.bus.sweep_s):
                    await self._refresh.wait()
            except TimeoutError:
                # The sweep: a wake lost in a failover must not leave a follower waiting forever.
                for conversation_id in self.subscriptions:
                    self.mark(conversation_id)
                continue
            self._refresh.clear()
            try:
                await self.bus.redis.nodes_manager.initialize()
            except _CLUSTER_ERRORS as exc:
                log.warning("cannot refresh the cluster's slot map", extra={"error": str(exc)})
                self._refresh.set()
                attempt += 1
                await asyncio.sleep(_backoff(attempt))
                continue
            attempt = 0
            await self._reassign()
            # At most one refresh per interval however many listeners report the same failover.
            await asyncio.sleep(self.bus.refresh_interval_s)

    async def _reassign(self) -> None:
        """Move each conversation's subscription to the master serving its slot now."""
        for conversation_id in list(self.subscriptions):
            listener = self._listener_of.get(conversation_id)
            channel = self.bus.keys.wake(conversation_id)
            try:
                node = self.bus.redis.get_node_from_key(channel)
            except _CLUSTER_ERRORS:
                node = None
            if listener is not None and node is not None and listener.name == node.name:
                continue
            if listener is not None:
                listener.remove(channel)
                del self._listener_of[conversation_id]
            self._assign(conversation_id)
        for name, listener in list(self._listeners.items()):
            if not listener.channels:
                del self._listeners[name]
                await listener.aclose()

    async def aclose(self) -> None:
        tasks = [self.task, self.topology_task]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._fail_all(BusClosedError("the event bus is closed"))
        for listener in self._listeners.values():
            await listener.aclose()
        self._listeners.clear()


class _ClusterWriter(StreamWriter):
    """The appends of a batch as one cluster pipeline (redis-py sends one pipeline per master)."""

    unreachable = _CLUSTER_ERRORS

    def __init__(self, bus: RedisClusterEventBus) -> None:
        self.bus = bus
        super().__init__(bus.maxlen, "redis-cluster-writer")

    async def _write(self, batch: list[Append]) -> list[Exception | None]:
        keys = self.bus.keys
        pipe = self.bus.redis.pipeline()
        for conversation_id, events in batch:
            key = keys.events(conversation_id)
            for event in events:
                pipe.execute_command(*xadd_command(key, self.maxlen, event))
            # A new run must not inherit the expiry the previous run's done set on the stream.
            pipe.persist(key)
            # Same slot, so the same connection, after the XADDs: a woken reader finds them.
            pipe.execute_command("SPUBLISH", keys.wake(conversation_id), "")
        results = await pipe.execute(raise_on_error=False)
        errors: list[Exception | None] = []
        at = 0
        for conversation_id, events in batch:
            errors.append(append_error(keys.events(conversation_id), events, results[at : at + len(events)]))
            at += len(events) + 2
        return errors


class RedisClusterEventBus(RedisStreamsBus[_ClusterStreamReader]):
    """``EventBus`` on the Redis Streams of a Redis Cluster (``{prefix}:events:{<conversation_id>}``).

    ``url`` names any node. The options are ``RedisEventBus``'s, and: ``sweep_s``, how often every
    followed stream is read whatever the wakes said; ``refresh_interval_s``, the least time between
    two refreshes of the slot map. ``pool_size`` caps the replays and probes in flight (callers
    wait for their turn); besides those, the process holds a connection per master for the
    reader, the writer and the wake listener.
    """

    unreachable: ClassVar[tuple[type[BaseException], ...]] = (
        RedisConnectionError,
        RedisTimeoutError,
        RedisClusterException,  # no node reachable, a slot not covered (mid-failover)
        OSError,
    )

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        maxlen: int | None = 100_000,
        follower_buffer: int = 4096,
        reconnect_s: float = 10.0,
        socket_timeout_s: float = 5.0,
        client_name: str | None = "agentstream-bus",
        pool_size: int = 16,
        sweep_s: float = 5.0,
        refresh_interval_s: float = 0.25,
    ) -> None:
        self.url = url
        self.maxlen = maxlen
        self.socket_timeout_s = socket_timeout_s
        self.client_name = client_name
        self.sweep_s = sweep_s
        self.refresh_interval_s = refresh_interval_s
        # No hidden retries (callers own the retry policy); redis-py still follows MOVED and ASK,
        # and refreshes its slot map after an error.
        redis = RedisCluster.from_url(
            url,
            decode_responses=True,
            protocol=2,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            client_name=client_name,
            max_connections=pool_size + 8,
        )
        super().__init__(
            redis, RedisKeys(prefix, cluster=True), follower_buffer=follower_buffer, reconnect_s=reconnect_s
        )
        self._calls = asyncio.Semaphore(pool_size)

    def _start_writer(self) -> StreamWriter:
        return _ClusterWriter(self)

    def _start_reader(self) -> _ClusterStreamReader:
        return _ClusterStreamReader(self)

    async def _call(self, method: Any, *args: Any) -> Any:
        async with self._calls:
            return await super()._call(method, *args)

    async def ping(self) -> bool:
        """True if every master answers (a failing-over one does not, until its replica took over)."""
        try:
            return bool(await self.redis.ping(target_nodes=RedisCluster.PRIMARIES))
        except _CLUSTER_ERRORS:
            return False

    async def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            await self._reader.aclose()
        if self._writer is not None:
            self._writer.task.cancel()
            try:
                await self._writer.task
            except asyncio.CancelledError:
                pass
        await self.redis.aclose()
