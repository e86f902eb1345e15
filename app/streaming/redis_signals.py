"""Cross-process run signals: cancel, released runs, and follow-up hints.

``RedisCancelSignal`` sets a key (so a late check still sees the request) and publishes on one
channel that each process listens to on a single pubsub connection; the same class, named
``released``, announces runs a stopping worker let go. ``MemoryCancelSignal`` is its in-process
twin for a service without Redis. ``RedisFollowUpHints`` tells a run on any worker that its
conversation got a follow-up (kept in the database: ``app.runs.follow_ups``). Both Redis classes
work on a Redis Cluster too (keys named by ``RedisKeys``; classic pub/sub reaches every node).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import random
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from app.streaming.redis_keys import RedisKeys

log = logging.getLogger("app.streaming.signals")

CancelCallback = Callable[[str], object]
"""Called with the run id; may return an awaitable, which is awaited."""

ActiveRuns = Callable[[], Iterable[str | tuple[str, str]]]
"""The runs of this process, as run ids or ``(run_id, conversation_id)`` pairs: the pairs where
requests name the conversation (on a cluster the key of a request hashes with it)."""

_REDIS_ERRORS = (RedisError, RedisClusterException, OSError)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class CancelSignal(Protocol):
    async def request(self, run_id: str, conversation_id: str | None = None) -> None:
        """Ask whichever process runs ``run_id`` to cancel it.

        ``conversation_id``, the run's, where the caller knows it: on a Redis Cluster the request's
        key then shares the conversation's slot. ``is_requested`` must be asked the same way.
        """
        ...

    async def is_requested(self, run_id: str, conversation_id: str | None = None) -> bool: ...

    async def listen(self, callback: CancelCallback) -> None:
        """Start calling ``callback(run_id)`` for every request; returns once listening."""
        ...

    async def close(self) -> None: ...


async def _invoke(callback: CancelCallback, run_id: str) -> None:
    try:
        result = callback(run_id)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("cancel callback failed", extra={"run_id": run_id})


class RedisCancelSignal:
    """Cross-process cancel: ``SET {prefix}:cancel:{run_id}`` with a TTL plus ``PUBLISH {prefix}:cancel``.

    ``listen()`` keeps one pubsub connection per process and reconnects with backoff. Requests
    published while it was disconnected are not replayed by Redis, so after reconnecting it checks
    the keys of the runs ``active_runs()`` names, if given. ``redis`` may be a ``RedisCluster``
    (``cluster=True``): the key is then ``RedisKeys.signal``'s, and the pubsub connection goes to
    any node, another one after each failure.
    """

    def __init__(
        self,
        redis: Redis | RedisCluster,
        prefix: str,
        *,
        ttl_s: int = 3600,
        name: str = "cancel",
        cluster: bool = False,
    ) -> None:
        """``name`` tells signals apart: ``cancel``, or ``released`` for runs a stopping worker let
        go (RUNS.md R-08), which wakes every worker's claim loop."""
        self._redis: Any = redis
        self._keys = RedisKeys(prefix, cluster=cluster)
        self._name = name
        self._channel = self._keys.signal_channel(name)
        self._ttl_s = ttl_s
        self._task: asyncio.Task[None] | None = None
        self._pubsub: Any = None
        self._callback: CancelCallback | None = None
        self._active_runs: ActiveRuns | None = None
        self._catch_ups: set[asyncio.Task[None]] = set()

    async def request(self, run_id: str, conversation_id: str | None = None) -> None:
        key = self._keys.signal(self._name, run_id, conversation_id)
        if self._keys.cluster:
            # The channel belongs to no slot: no transaction spans it and the key on a cluster.
            await self._redis.set(key, b"1", ex=self._ttl_s)
            await self._redis.publish(self._channel, run_id)
            return
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(key, b"1", ex=self._ttl_s)
        pipe.publish(self._channel, run_id)
        await pipe.execute()

    async def is_requested(self, run_id: str, conversation_id: str | None = None) -> bool:
        return bool(await self._redis.exists(self._keys.signal(self._name, run_id, conversation_id)))

    async def listen(self, callback: CancelCallback, active_runs: ActiveRuns | None = None) -> None:
        if self._task is not None:
            raise RuntimeError("already listening")
        self._callback, self._active_runs = callback, active_runs
        try:
            await self._subscribe()
        except _REDIS_ERRORS as exc:
            # A worker must start while Redis is down (its /readyz then says so); the listener
            # below keeps trying to subscribe.
            log.warning("cancel listener cannot reach Redis yet; retrying", extra={"error": str(exc)})
        self._task = asyncio.create_task(
            self._run(callback, active_runs), name="cancel-signal-listener", context=contextvars.Context()
        )

    async def _subscribe(self) -> None:
        if self._keys.cluster:
            # Any node hears every PUBLISH of a cluster; after a failure, most likely another one.
            await self._redis.initialize()
            node = random.choice(self._redis.get_nodes())
            pubsub: Any = self._redis.pubsub(node=node, ignore_subscribe_messages=True)
        else:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
        except BaseException:
            await pubsub.aclose()
            raise
        self._pubsub = pubsub
        if pubsub.connection is not None:
            # redis-py may reconnect and resubscribe by itself; we still must catch up then.
            pubsub.connection.register_connect_callback(self._on_reconnect)

    def _on_reconnect(self, connection: object) -> None:
        del connection
        if self._callback is None:
            return
        task = asyncio.create_task(self._catch_up(self._callback, self._active_runs))
        self._catch_ups.add(task)
        task.add_done_callback(self._catch_ups.discard)

    async def _catch_up(self, callback: CancelCallback, active_runs: ActiveRuns | None) -> None:
        """Requests sent while we were away only left their keys behind."""
        if active_runs is None:
            return
        try:
            for run in list(active_runs()):
                run_id, conversation_id = (run, None) if isinstance(run, str) else run
                if await self.is_requested(run_id, conversation_id):
                    await _invoke(callback, run_id)
        except _REDIS_ERRORS:
            log.warning("cancel catch-up failed", exc_info=True)

    async def _run(self, callback: CancelCallback, active_runs: ActiveRuns | None) -> None:
        attempt = 0
        while True:
            try:
                if self._pubsub is None:
                    await self._subscribe()
                    attempt = 0
                    await self._catch_up(callback, active_runs)
                async for message in self._pubsub.listen():
                    if message.get("type") == "message":
                        await _invoke(callback, _text(message["data"]))
                raise ConnectionError("pubsub connection ended")
            except asyncio.CancelledError:
                raise
            except _REDIS_ERRORS as exc:
                log.warning("cancel listener lost Redis; reconnecting", extra={"error": str(exc)})
                await self._drop_pubsub()
                attempt += 1
                await asyncio.sleep(min(2.0, 0.05 * 2.0**attempt) * (0.5 + random.random() / 2))

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            if pubsub.connection is not None:
                # The connection goes back to the pool: it must not call us when reused.
                pubsub.connection.deregister_connect_callback(self._on_reconnect)
            try:
                await pubsub.aclose()
            except _REDIS_ERRORS:
                pass

    async def close(self) -> None:
        self._callback = None
        for pending in list(self._catch_ups):
            pending.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self._drop_pubsub()


class MemoryCancelSignal:
    """In-process cancel signal with the interface of ``RedisCancelSignal``."""

    def __init__(self, *, ttl_s: float = 3600) -> None:
        self._ttl_s = ttl_s
        self._requested: dict[str, float] = {}
        self._callbacks: list[CancelCallback] = []

    async def request(self, run_id: str, conversation_id: str | None = None) -> None:
        del conversation_id  # one process: the run id alone names the request
        now = time.monotonic()
        # Forget old requests so the map cannot grow without bound.
        for old in [r for r, at in self._requested.items() if now - at > self._ttl_s]:
            del self._requested[old]
        self._requested[run_id] = now
        for callback in list(self._callbacks):
            await _invoke(callback, run_id)

    async def is_requested(self, run_id: str, conversation_id: str | None = None) -> bool:
        del conversation_id
        at = self._requested.get(run_id)
        return at is not None and time.monotonic() - at < self._ttl_s

    async def listen(self, callback: CancelCallback, active_runs: ActiveRuns | None = None) -> None:
        del active_runs  # nothing can be missed in-process
        self._callbacks.append(callback)

    async def close(self) -> None:
        self._callbacks.clear()


class RedisFollowUpHints:
    """``FollowUpHints`` across processes: ``{prefix}:followups:{conversation_id}`` (on a cluster
    ``{prefix}:followups:{<conversation_id>}``) holds a fresh random token after every follow-up (so
    a Redis restarted empty can never hand back a token a run already saw), for a day."""

    def __init__(
        self, redis: Redis | RedisCluster, prefix: str, *, ttl_s: int = 86_400, cluster: bool = False
    ) -> None:
        self._redis: Any = redis
        self._keys = RedisKeys(prefix, cluster=cluster)
        self._ttl_s = ttl_s

    async def version(self, conversation_id: str) -> object:
        token = await self._redis.get(self._keys.followups(conversation_id))
        return b"" if token is None else token

    async def bump(self, conversation_id: str) -> None:
        await self._redis.set(self._keys.followups(conversation_id), secrets.token_bytes(12), ex=self._ttl_s)
