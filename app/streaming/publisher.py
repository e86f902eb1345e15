"""``RunPublisher``: turns one run's engine events into stored events on the bus and in the database.

``publish()`` never waits for I/O. It assigns the event its id, encodes it once, and queues it; a
background sender pushes queued events to the bus in batches ("natural batching": at once when
idle, while a send is in flight the next batch accumulates), so latency is about one round trip at
low load and batches grow with load. Consecutive answer deltas still waiting to be sent merge into
one delta whose content is their exact concatenation. A second background task persists the same
events to the database in larger batches, retrying with backoff: the database is the durable
record, the bus is the fast path.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace

import orjson

from app.engine.events import AnswerDelta, EngineEvent
from app.streaming.bus import (
    BusClosedError,
    EventBus,
    EventOrderError,
    StoredEvent,
    next_cursor,
    parse_cursor,
)
from app.streaming.store import (
    AttemptLostError,
    CheckpointRecord,
    EventPersistError,
    EventStore,
    Fence,
    PublisherClosedError,
)

log = logging.getLogger("app.streaming.publisher")


MAX_DELTA_CHARS = 16_384
"""Deltas stop merging at about this size. Every reader holds whole events: unbounded, one fast
answer merged into events of megabytes, and each client that stopped reading held several."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class _PendingDelta:
    """Answer deltas merged while waiting for the sender; encoded when the sender takes them.

    ``eager``: the tokens come slowly, so waiting for more would only add latency.
    """

    __slots__ = ("eager", "id", "parts", "prev", "size")

    def __init__(self, event_id: str, prev: str | None, content: str, eager: bool) -> None:
        self.id = event_id
        self.prev = prev
        self.parts = [content]
        self.size = len(content)
        self.eager = eager


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _merged(checkpoints: list[CheckpointRecord]) -> list[CheckpointRecord]:
    """The checkpoints of one batch as one row: a JSON list of their deltas, under the last one's
    place (a row a batch, whatever the number of safe points it covers)."""
    if len(checkpoints) < 2:
        return checkpoints
    last = checkpoints[-1]
    taken = [c.follow_ups_through for c in checkpoints if c.follow_ups_through is not None]
    data = "[" + ",".join(c.data for c in checkpoints) + "]"
    return [replace(last, data=data, follow_ups_through=max(taken) if taken else None)]


def _backoff(attempt: int, cap: float) -> float:
    return min(cap, 0.02 * 2.0**attempt) * (0.5 + random.random() / 2)


class RunPublisher:
    """Publishes one run's events, in order, to the bus and the event store.

    ``last_id`` is the conversation's newest cursor before the run, so ids keep increasing across
    runs. ``on_published(events)`` is called after each batch reaches the bus. ``close()`` returns
    once everything published (the ``done`` event included) is on the bus and in the store, then
    sets the stream to expire in ``retention_s``.

    With ``store_before_bus`` (an in-process bus, which dies with the process) every event is
    stored before it reaches the bus. The bus is retried for ``bus_retry_s`` per batch; past that
    the batch is left to the store and the following batches get one attempt each until the bus
    answers again. Every entry names the
    event before it, so readers see the gap and fill it from the store. The store is retried for
    ``store_retry_s``, an error of ``permanent_store_errors`` not at all; past that
    ``flush()``/``close()`` raise ``EventPersistError``.
    """

    def __init__(
        self,
        bus: EventBus,
        store: EventStore,
        conversation_id: str,
        run_id: str,
        *,
        last_id: str | None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        coalesce_ms: float = 2.0,
        on_published: Callable[[list[StoredEvent]], object] | None = None,
        retention_s: float = 600,
        bus_retry_s: float = 30.0,
        store_retry_s: float = 120.0,
        permanent_store_errors: tuple[type[Exception], ...] = (),
        store_interval_ms: float = 500.0,
        store_before_bus: bool = False,
        store_batch: int = 500,
        bus_batch: int = 1000,
        fence: Fence | None = None,
        on_lost: Callable[[], object] | None = None,
    ) -> None:
        self.conversation_id = conversation_id
        self.run_id = run_id
        self._bus = bus
        self._store = store
        self._last_id = last_id
        self._clock_ms = clock_ms
        self._coalesce_s = max(0.0, coalesce_ms / 1000)
        self._on_published = on_published
        self._retention_s = retention_s
        self._bus_retry_s = bus_retry_s
        self._store_retry_s = store_retry_s
        self._permanent_store_errors = permanent_store_errors
        # An in-process bus dies with the process: what a client saw must be stored already, or
        # a restarted service would show it a log without it (RUNS.md ). Batches still
        # form while a write is in flight.
        self._store_before_bus = store_before_bus
        # The attempt whose events these are: the store keeps them only while it holds the run.
        self._fence = fence
        self._on_lost = on_lost
        self._store_interval_s = 0.0 if store_before_bus else max(0.0, store_interval_ms / 1000)
        self._store_batch = store_batch
        self._bus_batch = bus_batch

        self._pending: list[StoredEvent | _PendingDelta] = []
        self._pending_since = 0.0
        self._sending = False
        self._to_store: list[StoredEvent | CheckpointRecord] = []
        self._stored_ahead: set[str] = set()
        """Ids of events stored before the bus loop took them (``publish_stored``, ``flush_store``)."""
        self._saving = False
        self._stored_any = False
        self._bus_wake = asyncio.Event()
        self._store_wake = asyncio.Event()
        self._store_timer: asyncio.Future[None] | None = None
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._store_waiters: list[asyncio.Future[None]] = []
        self._last_delta_at = 0.0
        self._urgent = False
        self._closing = False
        self._closed = False
        self._done_published = False
        self._bus_given_up = False
        """No more bus for this run: its send loop crashed, or the bus was closed (shutdown)."""
        self._bus_down = False
        """The last batch was left to the store after the bus failed for ``bus_retry_s``: the next
        ones get one attempt each until one succeeds."""
        self._store_error: EventPersistError | None = None
        """The first failure to store (events missing from the log); flush()/close() raise it."""
        self._store_dead = False
        """The store loop stopped for good (it crashed, or the store refuses this run's events)."""
        self._store_down = False
        """The last batch was dropped after ``store_retry_s``: the next ones get one attempt each."""
        self._store_failing = False
        """The last save failed: with ``store_before_bus`` the bus does not wait for the store then
        (clients keep getting the run live through a database outage)."""
        self._dropped = 0
        """Batches given up after ``store_retry_s``."""
        self._bus_task: asyncio.Task[None] | None = None
        self._store_task: asyncio.Task[None] | None = None

    # ---- the engine's side -----------------------------------------------------------------

    async def publish(self, event: EngineEvent) -> StoredEvent | None:
        """Queue ``event``; returns its stored form, or None for an answer delta (it may still merge)."""
        if self._closing:
            raise PublisherClosedError(f"publisher of run {self.run_id} is closed")
        if self._bus_task is None:
            self._start()
        pending = self._pending
        if type(event) is AnswerDelta:
            if not event.content:
                return None
            now = time.monotonic()
            eager = now - self._last_delta_at > self._coalesce_s
            self._last_delta_at = now
            tail = pending[-1] if pending else None
            if type(tail) is _PendingDelta and tail.size < MAX_DELTA_CHARS:
                tail.parts.append(event.content)
                tail.size += len(event.content)
                return None
            self._queue(_PendingDelta(*self._next_id(), event.content, eager))
            return None
        stored = self.stamp(event)
        self._queue_event(stored)
        return stored

    def stamp(self, event: EngineEvent) -> StoredEvent:
        """``event`` as it will be stored, with its id (taken now) and its encoded payload, but not
        queued: for an event the caller stores itself and then hands to ``publish_stored()``, as
        the run manager does with a run's ``done`` (stored in the transaction that closes the run).
        Publish nothing else in between: this id comes before theirs."""
        if self._closing:
            raise PublisherClosedError(f"publisher of run {self.run_id} is closed")
        event_id, prev = self._next_id()
        return StoredEvent(event_id, event.channel, self._encode(event), self.run_id, prev)

    async def publish_stored(self, stored: StoredEvent) -> None:
        """Queue ``stored`` (from ``stamp()``), which the caller has stored: to the bus only."""
        if self._closing:
            raise PublisherClosedError(f"publisher of run {self.run_id} is closed")
        if self._bus_task is None:
            self._start()
        self._stored_ahead.add(stored.id)
        self._queue_event(stored)

    def checkpoint(self, record: CheckpointRecord) -> None:
        """Queue ``record`` for the store, after every event published so far (those still
        waiting for the bus are stored now and stay queued for it): a checkpoint is never stored
        ahead of the events it covers. ``flush_store()`` waits until it is stored."""
        if self._closing:
            raise PublisherClosedError(f"publisher of run {self.run_id} is closed")
        if self._bus_task is None:
            self._start()
        self._store_pending_now()
        self._to_store.append(replace(record, after=self._last_id))
        self._store_wake.set()

    def _queue_event(self, stored: StoredEvent) -> None:
        if stored.is_done:
            self._done_published = True
            self._urgent = True
            self._end_store_wait()
        self._queue(stored)

    async def flush(self) -> None:
        """Wait until everything published so far is on the bus (or given up) and in the store."""
        if self._bus_task is None:
            return
        self._urgent = True
        self._end_store_wait()
        self._bus_wake.set()
        self._store_wake.set()
        if not self._flushed():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._flush_waiters.append(waiter)
            await waiter
        self._urgent = self._done_published
        if self._store_error is not None:
            raise self._store_error

    async def flush_store(self) -> None:
        """Wait until everything published so far is in the store, whether or not the bus has it
        yet: what still waits for the bus (behind an append that hangs or is being retried
        through an outage) is stored now and stays queued for the bus. Raises the store's first
        failure of the run, if any."""
        await self._flush_store()
        if self._store_error is not None:
            raise self._store_error

    async def stored(self) -> None:
        """Wait until everything published and checkpointed so far is stored; raises only if some
        of that was not (a checkpoint that must survive the worker was not kept), unlike
        ``flush_store``, which also reports what an earlier outage cost."""
        dropped = self._dropped
        await self._flush_store()
        if self._store_dead or self._dropped != dropped:
            raise self._store_error or EventPersistError(f"events of run {self.run_id} were not stored")

    async def _flush_store(self) -> None:
        if self._bus_task is None:
            return
        self._urgent = True
        self._end_store_wait()
        self._store_wake.set()
        while not self._store_dead:
            self._store_pending_now()
            if not self._to_store and not self._saving:
                break
            await self._store_caught_up()
        self._urgent = self._done_published

    async def close(self) -> None:
        """Flush, stop the background tasks, and start the retention clock if ``done`` was sent."""
        if self._closed:
            return
        self._closing = True
        try:
            await self.flush()
        finally:
            self._closed = True
            await self._stop_tasks()
            if self._done_published and not self._bus_given_up:
                await self._start_retention()

    async def discard(self) -> None:
        """Stop at once, sending and storing nothing more of what is queued: for a run that another
        worker closed (with its own done), after which this run's events would be strays."""
        if self._closed:
            return
        self._closing = True
        self._closed = True
        self._pending.clear()
        self._to_store.clear()
        await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        for task in (self._bus_task, self._store_task):
            if task is not None:
                task.cancel()
        for task in (self._bus_task, self._store_task):
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    async def _start_retention(self) -> None:
        try:
            await self._bus.expire(self.conversation_id, int(self._retention_s))
        except Exception:
            log.warning("could not set the stream's expiry", extra=self._context, exc_info=True)

    # ---- internals -------------------------------------------------------------------------

    @property
    def _context(self) -> dict[str, str]:
        return {"conversation_id": self.conversation_id, "run_id": self.run_id}

    def _start(self) -> None:
        self._bus_task = asyncio.create_task(self._send_loop(), name=f"publish-bus-{self.run_id}")
        self._store_task = asyncio.create_task(self._store_loop(), name=f"publish-store-{self.run_id}")

    def _next_id(self) -> tuple[str, str | None]:
        """A new event's id, and the id before it (``StoredEvent.prev``)."""
        prev = self._last_id
        self._last_id = next_cursor(prev, self._clock_ms())
        return self._last_id, prev

    def _encode(self, event: EngineEvent) -> str:
        data = event.data()
        data["run_id"] = self.run_id
        # A tool may hand back arguments JSON cannot hold (sets, objects): show them as text
        # rather than fail the run.
        return orjson.dumps(data, default=str, option=orjson.OPT_NON_STR_KEYS).decode()

    def _queue(self, item: StoredEvent | _PendingDelta) -> None:
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(item)
        self._bus_wake.set()

    def _take(self) -> list[StoredEvent]:
        """Up to ``bus_batch`` pending items as stored events, each delta encoded once, now."""
        items = self._pending[: self._bus_batch]
        del self._pending[: len(items)]
        if self._pending:
            self._pending_since = time.monotonic()
        return [self._delta_event(item) if type(item) is _PendingDelta else item for item in items]  # type: ignore[misc]

    def _delta_event(self, delta: _PendingDelta) -> StoredEvent:
        """The merged delta as the one event it becomes, encoded once."""
        content = delta.parts[0] if len(delta.parts) == 1 else "".join(delta.parts)
        return StoredEvent(delta.id, "answer", self._encode(AnswerDelta(content)), self.run_id, delta.prev)

    def _to_store_later(self, batch: list[StoredEvent]) -> None:
        ahead = self._stored_ahead
        if ahead:
            kept = []
            for event in batch:
                if event.id in ahead:
                    ahead.discard(event.id)
                else:
                    kept.append(event)
            batch = kept
        if batch:
            self._to_store.extend(batch)
            self._store_wake.set()

    def _flushed(self) -> bool:
        bus_idle = (not self._pending and not self._sending) or self._bus_given_up
        store_idle = (not self._to_store and not self._saving) or self._store_dead
        return bus_idle and store_idle

    def _store_pending_now(self) -> None:
        """Queue for the store every event still waiting for the bus, its deltas merged and
        encoded now (they take no more tokens); the bus still gets them, in order."""
        for index, item in enumerate(self._pending):
            event = self._delta_event(item) if isinstance(item, _PendingDelta) else item
            self._pending[index] = event
            if event.id not in self._stored_ahead:
                self._stored_ahead.add(event.id)
                self._to_store.append(event)
                self._store_wake.set()

    def _notify(self) -> None:
        if self._store_waiters and ((not self._to_store and not self._saving) or self._store_dead):
            store_waiters, self._store_waiters = self._store_waiters, []
            for waiter in store_waiters:
                _resolve(waiter)
        if self._flush_waiters and self._flushed():
            waiters, self._flush_waiters = self._flush_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _store_caught_up(self) -> None:
        """Wait until the store has saved everything queued for it (or has failed for good)."""
        while (self._to_store or self._saving) and not self._store_dead:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._store_waiters.append(waiter)
            await waiter

    async def _stored_unless_failing(self) -> None:
        """Wait until the store has saved everything queued for it, or is failing."""
        while (self._to_store or self._saving) and not self._store_dead and not self._store_failing:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._store_waiters.append(waiter)
            await waiter

    def _wake_store_waiters(self) -> None:
        waiters, self._store_waiters = self._store_waiters, []
        for waiter in waiters:
            _resolve(waiter)

    def _end_store_wait(self) -> None:
        if self._store_timer is not None and not self._store_timer.done():
            self._store_timer.set_result(None)

    async def _send_loop(self) -> None:
        try:
            await self._send_forever()
        except Exception:
            # Never leave flush() waiting on a dead loop; the store still gets what it can.
            log.exception(
                "event publisher crashed; the bus gets nothing more from this run", extra=self._context
            )
            self._bus_given_up = True
            self._sending = False
            self._notify()

    async def _send_forever(self) -> None:
        while True:
            if not self._pending:
                self._bus_wake.clear()
                await self._bus_wake.wait()
                continue
            tail = self._pending[-1]
            if self._coalesce_s and not self._urgent and type(tail) is _PendingDelta and not tail.eager:
                # Tokens are coming fast: a short window in which more merge into this delta.
                wait = self._pending_since + self._coalesce_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            self._sending = True
            batch = self._take()
            if not self._store_dead:
                self._to_store_later(batch)
                if any(event.is_done for event in batch):
                    # A client that sees done may read the run's events from the database next
                    # (GET /api/runs/{id}/events): they must all be there by then.
                    await self._store_caught_up()
                elif self._store_before_bus:
                    await self._stored_unless_failing()
            try:
                if not self._bus_given_up:
                    await self._send(batch)
            finally:
                self._sending = False
            self._notify()

    async def _send(self, batch: list[StoredEvent]) -> None:
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                if first_failure is not None:
                    # The failed attempt may have appended a prefix of the batch: skip what is there.
                    held = await self._bus.last_id(self.conversation_id)
                    if held is not None:
                        held_key = parse_cursor(held)
                        batch = [e for e in batch if parse_cursor(e.id) > held_key]
                if batch:
                    await self._bus.append(self.conversation_id, batch)
            except asyncio.CancelledError:
                raise
            except BusClosedError:
                # This process is shutting down: no retry will find the bus open again. The store
                # keeps the events; readers elsewhere get them from there.
                self._bus_given_up = True
                return
            except Exception as exc:
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                if self._bus_down or now - first_failure > self._bus_retry_s:
                    # Past the retry budget (or the bus is already known to be down): this batch
                    # is left to the store. Later batches still go to the bus, naming the events
                    # before them (``prev``), so a reader sees the gap and fills it from the
                    # database; the bus is never given up for the rest of the run, which would
                    # leave its followers waiting for events that only the database gets.
                    if not self._bus_down:
                        log.error(
                            "event bus unusable; events go to the database only until it answers",
                            extra={**self._context, "error": str(exc)},
                        )
                    self._bus_down = True
                    return
                if isinstance(exc, EventOrderError) and attempt > 0:
                    log.error(
                        "event bus holds later events than this run's; batch left to the database",
                        extra={**self._context, "error": str(exc)},
                    )
                    return
                log.warning(
                    "event bus append failed; retrying",
                    extra={**self._context, "error": str(exc)},
                )
                # The run goes on meanwhile: what it published since is stored now (readers get
                # it from the database while the bus is down) and joins this batch for the bus.
                batch = batch + await self._take_during_outage()
                await asyncio.sleep(_backoff(attempt, 1.0))
                attempt += 1
                continue
            if self._bus_down:
                log.info("event bus answers again", extra=self._context)
                self._bus_down = False
            if batch and self._on_published is not None:
                try:
                    self._on_published(batch)
                except Exception:
                    log.warning("on_published callback failed", exc_info=True)
            return

    async def _take_during_outage(self) -> list[StoredEvent]:
        """Events published while a bus append is retried, queued for the store at once."""
        if not self._pending:
            return []
        more = self._take()
        if not self._store_dead:
            self._to_store_later(more)
            if any(event.is_done for event in more):
                await self._store_caught_up()  # as in _send_forever: done after everything else
        return more

    async def _lost(self, exc: AttemptLostError) -> None:
        """Another attempt holds the run now: nothing more of this one may reach the log or the
        bus (the store refused this batch already). Stays parked, like a permanent store error."""
        log.warning("this attempt lost its run; publishing stops", extra={**self._context, "error": str(exc)})
        self._store_error = exc
        self._store_dead = True
        self._bus_given_up = True
        self._pending.clear()
        self._to_store.clear()
        self._notify()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.warning("on_lost callback failed", exc_info=True)
        await asyncio.Event().wait()

    async def _store_loop(self) -> None:
        try:
            await self._store_forever()
        except Exception as exc:
            log.exception("event persister crashed", extra=self._context)
            self._store_error = EventPersistError(f"event persister of run {self.run_id} crashed: {exc!r}")
            self._store_dead = True
            self._saving = False
            self._to_store.clear()
            self._notify()

    async def _store_forever(self) -> None:
        while True:
            if not self._to_store:
                self._store_wake.clear()
                await self._store_wake.wait()
                continue
            if self._store_interval_s and not self._urgent and self._stored_any:
                # Let a larger batch build up: database writes cost far more than Redis appends.
                # Not for the run's first events: a reader whose cursor the bus does not hold
                # waits for the database to reach the bus's first event (app.streaming.resume).
                # flush() and done end the wait early.
                loop = asyncio.get_running_loop()
                timer = self._store_timer = loop.create_future()
                handle = loop.call_later(self._store_interval_s, _resolve, timer)
                try:
                    await timer
                finally:
                    handle.cancel()
                    self._store_timer = None
            self._saving = True
            try:
                await self._save(self._to_store[: self._store_batch])
            finally:
                self._saving = False
                self._stored_any = True
            self._notify()

    async def _save(self, batch: list[StoredEvent | CheckpointRecord]) -> None:
        events = [item for item in batch if type(item) is StoredEvent]
        checkpoints = _merged([item for item in batch if type(item) is CheckpointRecord])
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                if self._fence is not None:
                    await self._store.save(self.conversation_id, events, checkpoints, self._fence)
                elif checkpoints:
                    await self._store.save(self.conversation_id, events, checkpoints)
                else:
                    await self._store.save(self.conversation_id, events)
            except asyncio.CancelledError:
                raise
            except AttemptLostError as exc:
                await self._lost(exc)
            except Exception as exc:
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                # A permanent error (the conversation was deleted) will not pass by retrying.
                permanent = isinstance(exc, self._permanent_store_errors)
                if permanent:
                    self._store_error = EventPersistError(f"events of run {self.run_id} refused: {exc}")
                    log.info(
                        "event store refuses this run's events for good; they are not persisted",
                        extra={**self._context, "error": str(exc)},
                    )
                    self._store_dead = True
                    self._to_store.clear()
                    self._notify()
                    # Stay parked: flush() reports the error; nothing more can be saved.
                    await asyncio.Event().wait()
                if self._store_down or now - first_failure > self._store_retry_s:
                    # Past the retry budget (or the store is known to be down): this batch is lost
                    # to the log (its clients had it from the bus), and flush()/close() will say
                    # so; the following batches get one attempt each until the store answers.
                    if self._store_error is None:
                        self._store_error = EventPersistError(
                            f"could not store some events of run {self.run_id} "
                            f"(tried for {self._store_retry_s:.0f}s): {exc}"
                        )
                    if not self._store_down:
                        log.error(
                            "event store unusable; events are not persisted until it answers",
                            extra={**self._context, "error": str(exc)},
                        )
                    self._store_down = True
                    self._store_failing = True
                    self._dropped += 1
                    del self._to_store[: len(batch)]
                    return
                log.warning(
                    "event store save failed; retrying",
                    extra={**self._context, "error": str(exc)},
                )
                if not self._store_failing:
                    self._store_failing = True
                    self._wake_store_waiters()
                await asyncio.sleep(_backoff(attempt, 2.0))
                attempt += 1
                continue
            self._store_failing = False
            if self._store_down:
                log.info("event store answers again", extra=self._context)
                self._store_down = False
            del self._to_store[: len(batch)]
            return
