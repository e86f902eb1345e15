"""``RunPublisher``: turns one run's engine events into stored events on the bus and in the database.

``publish()`` never waits for I/O. It assigns the event its id, encodes it once, and queues it; a
background sender pushes queued events to the bus in batches ("natural batching": at once when
idle, while a send is in flight the next batch accumulates), so latency is about one round trip at
low load and batches grow with load. When the run is idle and nothing has to wait, ``publish()``
sends the event itself (a Redis bus's ``append_nowait``) and the bus's answer completes it by a
callback: the per-token path without waking the sender twice (bench/NOTES.md, sixth session); the
sender takes what has to wait, every ``done``, and the retries of such a send that failed.
Consecutive answer deltas still waiting to be sent merge into one delta whose content is their
exact concatenation. A second background task persists the same
events to the database in larger batches, retrying with backoff: the database is the durable
record, the bus is the fast path.

This module holds the bus side: ids, encoding, merging deltas, the send loop and its retries. The
store side (the queue for the database, batched saves, their retries and failures, waiting until
the store has caught up) is ``StoreWriter`` in ``app.streaming.store_writer``; the publisher owns
one and hands it what it must store, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from app.engine.events import AnswerDelta, EngineEvent
from app.streaming.bus import (
    BusClosedError,
    EventBus,
    EventOrderError,
    StoredEvent,
    next_cursor,
    parse_cursor,
)
from app.streaming.stamp import encode_event, wall_clock_ms
from app.streaming.store import (
    CheckpointRecord,
    EventPersistError,
    EventStore,
    Fence,
    PublisherClosedError,
)
from app.streaming.store_writer import StoreWriter, backoff

log = logging.getLogger("app.streaming.publisher")


MAX_DELTA_CHARS = 16_384
"""Deltas stop merging at about this size. Every reader holds whole events: unbounded, one fast
answer merged into events of megabytes, and each client that stopped reading held several."""


class _PendingDelta:
    """Answer deltas merged while waiting for the sender; encoded when the sender takes them.

    ``eager``: the tokens come slowly, so waiting for more would only add latency (unless the
    publisher's ``linger_ms`` says to wait anyway).
    """

    __slots__ = ("eager", "id", "parts", "prev", "size")

    def __init__(self, event_id: str, prev: str | None, content: str, eager: bool) -> None:
        self.id = event_id
        self.prev = prev
        self.parts = [content]
        self.size = len(content)
        self.eager = eager


class RunPublisher:
    """Publishes one run's events, in order, to the bus and the event store.

    ``last_id`` is the conversation's newest cursor before the run, so ids keep increasing across
    runs. ``on_published(events)`` is called after each batch reaches the bus. ``close()`` returns
    once everything published (the ``done`` event included) is on the bus and in the store, then
    sets the stream to expire in ``retention_s``.

    Answer deltas published close together merge into one event (``coalesce_ms``); with
    ``linger_ms`` every delta waits that long for more to merge with it.

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
        linger_ms: float = 0.0,
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
        self._last_id = last_id
        self._clock_ms = clock_ms
        self._coalesce_s = max(0.0, coalesce_ms / 1000)
        self._linger_s = max(0.0, linger_ms / 1000)
        self._on_published = on_published
        self._retention_s = retention_s
        self._bus_retry_s = bus_retry_s
        # An in-process bus dies with the process: what a client saw must be stored already, or
        # a restarted service would show it a log without it (RUNS.md ). Batches still
        # form while a write is in flight.
        self._store_before_bus = store_before_bus
        self._on_lost = on_lost
        self._bus_batch = bus_batch
        self._writer = StoreWriter(
            store,
            conversation_id,
            run_id,
            fence=fence,
            retry_s=store_retry_s,
            permanent_errors=permanent_store_errors,
            interval_s=0.0 if store_before_bus else max(0.0, store_interval_ms / 1000),
            batch=store_batch,
            urgent=lambda: self._urgent,
            on_progress=self._notify,
            on_lost=self._lost,
        )

        self._pending: list[StoredEvent | _PendingDelta] = []
        self._pending_since = 0.0
        self._sending = False
        self._bus_wake = asyncio.Event()
        self._flush_waiters: list[asyncio.Future[None]] = []
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
        self._bus_task: asyncio.Task[None] | None = None
        # Sends made by ``publish()`` itself (``_send_now``): the bus's append that does not wait,
        # None where every event goes through the send loop (the in-process bus stores first).
        self._append_nowait: Callable[[str, list[StoredEvent]], asyncio.Future[None]] | None = (
            None if store_before_bus else getattr(bus, "append_nowait", None)
        )
        self._direct: list[StoredEvent] | None = None
        """The batch ``publish()`` sent itself, while the bus has not answered for it."""
        self._retry: tuple[list[StoredEvent], Exception] | None = None
        """A direct batch whose append failed, for the send loop to retry."""

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
            if eager and self._can_send_now():
                self._send_now(self.stamp(event))
                return None
            self._queue(_PendingDelta(*self._next_id(), event.content, eager))
            return None
        stored = self.stamp(event)
        if not stored.is_done and self._can_send_now():
            self._send_now(stored)
        else:
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
        self._writer.stored_elsewhere(stored.id)
        self._queue_event(stored)

    @property
    def checkpoints_lost(self) -> bool:
        """Some checkpoint was not stored, and no whole-state one since: the next must be whole."""
        return self._writer.checkpoints_lost

    def checkpoint(self, record: CheckpointRecord) -> None:
        """Queue ``record`` for the store, after every event published so far (those still
        waiting for the bus are stored now and stay queued for it): a checkpoint is never stored
        ahead of the events it covers. ``flush_store()`` waits until it is stored."""
        if self._closing:
            raise PublisherClosedError(f"publisher of run {self.run_id} is closed")
        if self._bus_task is None:
            self._start()
        self._store_pending_now()
        self._writer.queue(replace(record, after=self._last_id))

    def _queue_event(self, stored: StoredEvent) -> None:
        if stored.is_done:
            self._done_published = True
            self._urgent = True
            self._writer.hurry()
        self._queue(stored)

    async def flush(self) -> None:
        """Wait until everything published so far is on the bus (or given up) and in the store."""
        if self._bus_task is None:
            return
        self._urgent = True
        self._writer.hurry()
        self._bus_wake.set()
        self._writer.wake()
        if not self._flushed():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._flush_waiters.append(waiter)
            await waiter
        self._urgent = self._done_published
        if self._writer.error is not None:
            raise self._writer.error

    async def flush_store(self) -> None:
        """Wait until everything published so far is in the store, whether or not the bus has it
        yet: what still waits for the bus (behind an append that hangs or is being retried
        through an outage) is stored now and stays queued for the bus. Raises the store's first
        failure of the run, if any."""
        await self._flush_store()
        if self._writer.error is not None:
            raise self._writer.error

    async def stored(self) -> None:
        """Wait until everything published and checkpointed so far is stored; raises only if some
        of that was not (a checkpoint that must survive the worker was not kept), unlike
        ``flush_store``, which also reports what an earlier outage cost."""
        dropped = self._writer.dropped
        await self._flush_store()
        if self._writer.dead or self._writer.dropped != dropped or self._writer.checkpoints_lost:
            raise self._writer.error or EventPersistError(f"events of run {self.run_id} were not stored")
        # Stored, and by the attempt that holds the run: a tool that must not run twice may start.
        await self._writer.check_held()

    async def _flush_store(self) -> None:
        if self._bus_task is None:
            return
        self._urgent = True
        self._writer.hurry()
        self._writer.wake()
        while not self._writer.dead:
            self._store_pending_now()
            if self._writer.idle:
                break
            await self._writer.caught_up()
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
        self._writer.clear()
        await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        for task in (self._bus_task, self._writer.task):
            if task is not None:
                task.cancel()
        for task in (self._bus_task, self._writer.task):
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
        self._writer.start()

    def _next_id(self) -> tuple[str, str | None]:
        """A new event's id, and the id before it (``StoredEvent.prev``)."""
        prev = self._last_id
        self._last_id = next_cursor(prev, self._clock_ms())
        return self._last_id, prev

    def _encode(self, event: EngineEvent) -> str:
        return encode_event(event, self.run_id)

    def _queue(self, item: StoredEvent | _PendingDelta) -> None:
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(item)
        if self._direct is None:  # else the direct send's answer wakes the loop
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

    def _can_send_now(self) -> bool:
        """Whether ``publish()`` may send an event to the bus itself: nothing of the run queued
        or in flight (the order stays), the bus healthy, and no wait the send loop would make
        first (a linger or coalescing window, a stale lease to confirm, a done's store, an outage)."""
        return (
            self._append_nowait is not None
            and not self._linger_s  # a linger batches in the send loop, every event with the others
            and not self._pending
            and not self._sending
            and not self._bus_down
            and not self._bus_given_up
            and not self._writer.dead
            and not self._writer.must_confirm()
        )

    def _send_now(self, stored: StoredEvent) -> None:
        """The send loop's work for one event, done by ``publish()`` without waking the loop (the
        per-token path, bench/NOTES.md sixth session): queued for the store, then handed to the
        bus's writer; ``_sent_now`` takes the answer."""
        assert self._append_nowait is not None
        batch = [stored]
        self._writer.queue_taken(batch)  # queued for the store before it is sent, as always
        try:
            future = self._append_nowait(self.conversation_id, batch)
        except BusClosedError:
            # Shutting down (as ``_send`` has it): the store keeps it, readers elsewhere read it there.
            self._bus_given_up = True
            self._notify()
            return
        self._sending = True
        self._direct = batch
        future.add_done_callback(self._sent_now)

    def _sent_now(self, future: asyncio.Future[None]) -> None:
        batch, self._direct = self._direct, None
        error = BusClosedError("the event bus is closed") if future.cancelled() else future.exception()
        if error is not None and not isinstance(error, Exception):
            error = BusClosedError(f"the event bus append ended with {error!r}")
        if batch is None or self._closed:
            self._sending = False
            return  # discarded meanwhile: nothing more of this run counts
        if error is None or isinstance(error, BusClosedError) or self._bus_given_up:
            self._sending = False
            if error is None:
                self._published(batch)
            elif isinstance(error, BusClosedError):
                self._bus_given_up = True
            self._notify()
            if self._pending:
                self._bus_wake.set()
            return
        # The retries and the outage's rules are the send loop's: it takes the batch from here.
        self._retry = (batch, error)
        self._bus_wake.set()

    def _published(self, batch: list[StoredEvent]) -> None:
        """``batch`` reached the bus: tell ``on_published``."""
        if self._on_published is not None:
            try:
                self._on_published(batch)
            except Exception:
                log.warning("on_published callback failed", exc_info=True)

    def _flushed(self) -> bool:
        bus_idle = (not self._pending and not self._sending) or self._bus_given_up
        store_idle = self._writer.idle or self._writer.dead
        return bus_idle and store_idle

    def _store_pending_now(self) -> None:
        """Queue for the store every event still waiting for the bus, its deltas merged and
        encoded now (they take no more tokens); the bus still gets them, in order."""
        for index, item in enumerate(self._pending):
            event = self._delta_event(item) if isinstance(item, _PendingDelta) else item
            self._pending[index] = event
            self._writer.queue_ahead(event)
        if self._pending:
            self._bus_wake.set()  # no delta waits any longer: no linger for what is stored already

    def _notify(self) -> None:
        if self._flush_waiters and self._flushed():
            waiters, self._flush_waiters = self._flush_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _lost(self) -> None:
        """The attempt lost its run (the writer stopped storing): nothing more of it may reach the
        bus either."""
        self._bus_given_up = True
        self._pending.clear()
        self._notify()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.warning("on_lost callback failed", exc_info=True)

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
            if self._retry is not None:
                batch, error = self._retry
                self._retry = None
                try:
                    await self._send(batch, failed=error)
                finally:
                    self._sending = False
                self._notify()
                continue
            if self._direct is not None or not self._pending:
                # Idle, or behind a batch publish() sent itself: its answer wakes this loop.
                self._bus_wake.clear()
                await self._bus_wake.wait()
                continue
            tail = self._pending[-1]
            if not self._urgent and len(self._pending) == 1 and type(tail) is _PendingDelta:
                # Tokens coming fast merge for ``coalesce_ms``; any token waits ``linger_ms`` for the
                # next to merge with it (fewer events per token: the bus, the store and every
                # client's socket do less for each). Never when another event waits with it.
                window = max(self._linger_s, 0.0 if tail.eager else self._coalesce_s)
                wait = self._pending_since + window - time.monotonic()
                if wait > 0:
                    # Cut short by anything that must not wait: another event, a flush, the done.
                    self._bus_wake.clear()
                    timer = asyncio.get_running_loop().call_later(wait, self._bus_wake.set)
                    try:
                        await self._bus_wake.wait()
                    finally:
                        timer.cancel()
                    continue
            self._sending = True
            batch = self._take()
            if not self._writer.dead:
                self._writer.queue_taken(batch)
                if any(event.is_done for event in batch):
                    # A client that sees done may read the run's events from the database next
                    # (GET /api/runs/{id}/events): they must all be there by then.
                    await self._writer.caught_up()
                elif self._store_before_bus:
                    await self._writer.caught_up_unless_failing()
            try:
                await self._writer.confirm_if_stale()
                if not self._bus_given_up:
                    await self._send(batch)
            finally:
                self._sending = False
            self._notify()

    async def _send(self, batch: list[StoredEvent], failed: Exception | None = None) -> None:
        """Append ``batch``, retried as the class says; ``failed``: its first append already
        failed so (a direct send's), and the retries start from there."""
        first_failure: float | None = None
        attempt = 0
        while True:
            if self._bus_given_up:
                return  # the attempt lost its run (or the bus closed) while this waited
            try:
                if failed is not None:
                    error, failed = failed, None
                    raise error
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
                await asyncio.sleep(backoff(attempt, 1.0))
                attempt += 1
                continue
            if self._bus_down:
                log.info("event bus answers again", extra=self._context)
                self._bus_down = False
            if batch:
                self._published(batch)
            return

    async def _take_during_outage(self) -> list[StoredEvent]:
        """Events published while a bus append is retried, queued for the store at once."""
        if not self._pending:
            return []
        more = self._take()
        if not self._writer.dead:
            self._writer.queue_taken(more)
            if any(event.is_done for event in more):
                await self._writer.caught_up()  # as in _send_forever: done after everything else
        return more
