"""``StoreWriter``: the store side of a run's publisher (``app.streaming.publisher``).

The publisher owns one. It queues the run's events and checkpoint records in the order the
publisher hands them over, and a background task saves them to the ``EventStore`` in batches,
retrying with backoff. The writer keeps track of how the store is doing (``error``, ``dead``,
``down``, ``failing``, ``dropped``) and lets callers wait until it has caught up. It tells the
publisher through ``on_progress`` each time it gets further or stops, so the publisher can wake
whoever waits in ``flush()``. Through ``on_lost`` it says that the attempt lost its run, and the
bus then gets nothing more either. The bus side (sending, merging deltas) stays in the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace

from app.streaming.bus import StoredEvent
from app.streaming.store import (
    AttemptLostError,
    CheckpointRecord,
    EventPersistError,
    EventStore,
    Fence,
)

log = logging.getLogger("app.streaming.publisher")  # the publisher's log: both its halves write to it


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def backoff(attempt: int, cap: float) -> float:
    """Jittered exponential backoff; the publisher's bus retries use it too."""
    return min(cap, 0.02 * 2.0**attempt) * (0.5 + random.random() / 2)


def _placed(checkpoint: CheckpointRecord) -> str:
    """A delta's JSON object with the id of the last event it covers (cursors need no escaping)."""
    if checkpoint.after is None or not checkpoint.data.startswith("{"):
        return checkpoint.data
    rest = checkpoint.data[1:]
    return f'{{"@a":"{checkpoint.after}"' + ("," + rest if rest != "}" else "}")


def _merged(checkpoints: list[CheckpointRecord]) -> list[CheckpointRecord]:
    """The checkpoints of one batch as one row: a JSON list of their deltas, under the last one's
    place (a row a batch, whatever the number of safe points it covers). Each delta keeps the last
    event it covers as ``"@a"``: a run is replayed from any of its safe points (FACES.md B-06)."""
    if len(checkpoints) < 2:
        return checkpoints
    last = checkpoints[-1]
    taken = [c.follow_ups_through for c in checkpoints if c.follow_ups_through is not None]
    data = "[" + ",".join(_placed(c) for c in checkpoints) + "]"
    full = any(c.full for c in checkpoints)
    return [replace(last, data=data, follow_ups_through=max(taken) if taken else None, full=full)]


_phase = random.random()
"""Where this process's save moments lie within the interval (a fraction of it): its runs' batches
end together, other processes' (a shared SQLite file's one writer) at other moments. Drawn again in
a forked child, which would otherwise share its parent's."""


def _draw_phase() -> None:
    global _phase
    _phase = random.random()


os.register_at_fork(after_in_child=_draw_phase)


def next_tick(now: float, interval_s: float) -> float:
    """The first of the process's save moments after ``now``: one every ``interval_s`` on a grid that
    every run of the process shares. A run's batch that waited from its own first event instead
    would end at its own moment, and the event store's group commit (``EventRepo.save``) would get
    the runs' saves one by one: at 40 streaming runs about 55 event-save transactions a second,
    where the grid leaves about 7, the runs' first and urgent saves (bench/NOTES.md)."""
    offset = _phase * interval_s
    return (math.floor((now - offset) / interval_s) + 1) * interval_s + offset


CONFIRM_BACKOFF_S = 2.0
"""After a check of the attempt's hold that could not tell (the store did not answer), the bus goes
on this long before the next check."""


class StoreWriter:
    """Saves one run's events and checkpoints to ``store``, in order, in batches of up to
    ``batch``. Apart from the run's first events and unless ``urgent()`` says otherwise, it waits
    for the next of the process's save moments (``next_tick``, one every ``interval_s``) so that
    they can grow.

    A batch is retried for ``retry_s``, and an error of ``permanent_errors`` is not retried at
    all. A batch still failing past ``retry_s`` is dropped and counted in ``dropped``, and later
    batches get one attempt each until the store answers again. With ``fence``, a save that
    raises ``AttemptLostError`` stops everything: the writer calls ``on_lost()`` and saves nothing
    more.
    """

    def __init__(
        self,
        store: EventStore,
        conversation_id: str,
        run_id: str,
        *,
        fence: Fence | None,
        retry_s: float,
        permanent_errors: tuple[type[Exception], ...],
        interval_s: float,
        batch: int,
        urgent: Callable[[], bool],
        on_progress: Callable[[], object],
        on_lost: Callable[[], object],
    ) -> None:
        self.conversation_id = conversation_id
        self.run_id = run_id
        self._store = store
        # The attempt whose events these are: the store keeps them only while it holds the run.
        self._fence = fence
        self._retry_s = retry_s
        self._permanent_errors = permanent_errors
        self._interval_s = interval_s
        self._batch = batch
        self._urgent = urgent
        self._on_progress = on_progress
        self._on_lost = on_lost

        self._queued: list[StoredEvent | CheckpointRecord] = []
        self._stored_ahead: set[str] = set()
        """Ids of events stored before the bus loop took them (the publisher's ``publish_stored``,
        ``flush_store``)."""
        self._saving = False
        self._stored_any = False
        self._wake = asyncio.Event()
        self._timer: asyncio.Future[None] | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self.error: EventPersistError | None = None
        """The first failure to store (events missing from the log); flush()/close() raise it."""
        self.dead = False
        """The store loop stopped for good (it crashed, or the store refuses this run's events)."""
        self.down = False
        """The last batch was dropped after ``retry_s``: the next ones get one attempt each."""
        self.failing = False
        """The last save failed: with ``store_before_bus`` the bus does not wait for the store then
        (clients keep getting the run live through a database outage)."""
        self.dropped = 0
        """Batches given up after ``retry_s``."""
        self.checkpoints_lost = False
        self._confirm_after = 0.0
        self._held_at = -math.inf
        """When this attempt last confirmed its hold itself (a check, a fenced save): until it has,
        the worker's heartbeat is what says it holds it."""
        """A dropped batch held checkpoints, and no whole-state checkpoint was stored since: the
        stored ones do not fold into the run's state until one is."""
        self.task: asyncio.Task[None] | None = None

    # ---- the publisher's side --------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.create_task(self._store_loop(), name=f"publish-store-{self.run_id}")

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing being saved."""
        return not self._queued and not self._saving

    def queue(self, item: StoredEvent | CheckpointRecord) -> None:
        """Queue ``item`` after everything queued so far."""
        self._queued.append(item)
        self._wake.set()

    def queue_ahead(self, event: StoredEvent) -> None:
        """Queue ``event`` now, before the bus loop takes it (``queue_taken`` then skips it)."""
        if event.id not in self._stored_ahead:
            self._stored_ahead.add(event.id)
            self._queued.append(event)
            self._wake.set()

    def stored_elsewhere(self, event_id: str) -> None:
        """The caller stored this event itself: ``queue_taken`` skips it."""
        self._stored_ahead.add(event_id)

    def queue_taken(self, batch: list[StoredEvent]) -> None:
        """Queue a batch the bus loop took, but not the events in it that were stored ahead."""
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
            self._queued.extend(batch)
            self._wake.set()

    def clear(self) -> None:
        """Forget everything queued."""
        self._queued.clear()

    def wake(self) -> None:
        """Have the store loop look at its queue again."""
        self._wake.set()

    def hurry(self) -> None:
        """End the wait for a larger batch, if the writer is in one."""
        if self._timer is not None and not self._timer.done():
            self._timer.set_result(None)

    async def caught_up(self) -> None:
        """Wait until the store has saved everything queued for it (or has failed for good)."""
        while (self._queued or self._saving) and not self.dead:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    async def caught_up_unless_failing(self) -> None:
        """Wait until the store has saved everything queued for it, or is failing."""
        while (self._queued or self._saving) and not self.dead and not self.failing:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    # ---- internals -------------------------------------------------------------------------

    @property
    def _context(self) -> dict[str, str]:
        return {"conversation_id": self.conversation_id, "run_id": self.run_id}

    def _progressed(self) -> None:
        """Wake whoever waits for the store to catch up, then tell the publisher."""
        if self._waiters and (self.idle or self.dead):
            self._wake_waiters()
        self._on_progress()

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _resolve(waiter)

    async def _lost(self, exc: AttemptLostError) -> None:
        """Another attempt holds the run now: nothing more of this one may reach the log or the
        bus (the store refused this batch already). Stays parked, like a permanent store error."""
        self._mark_lost(exc)
        await asyncio.Event().wait()

    def _mark_lost(self, exc: AttemptLostError) -> None:
        log.warning("this attempt lost its run; publishing stops", extra={**self._context, "error": str(exc)})
        self.error = exc
        self.dead = True
        self._queued.clear()
        # Waiters first, then the publisher stops its bus side and tells the run (which may
        # cancel the task that waits).
        self._progressed()
        self._on_lost()

    async def check_held(self) -> None:
        """Raise ``AttemptLostError`` (and stop, as when a save finds it) unless the attempt still
        holds its run; renews its lease. Nothing to check without a fence."""
        if self._fence is None or self.dead:
            return
        asked_at = time.monotonic()
        if not await self._store.holds_run(self._fence):
            self._mark_lost(AttemptLostError(f"attempt {self._fence.attempt} of {self.run_id} lost the run"))
            raise self.error  # type: ignore[misc]
        self._held_at = asked_at  # and its lease renewed from then

    def _unconfirmed(self) -> bool:
        """Whether this attempt's hold needs confirming: the worker's heartbeat has not confirmed
        its leases for half a lease, and neither has a check or fenced save of this attempt."""
        fence = self._fence
        return fence is not None and fence.stale() and time.monotonic() - self._held_at > fence.lease_s / 2

    def must_confirm(self) -> bool:
        """Whether ``confirm_if_stale`` would ask the store now (otherwise it returns at once)."""
        return (
            self._fence is not None
            and not self.dead
            and self._unconfirmed()
            and time.monotonic() >= self._confirm_after
        )

    async def confirm_if_stale(self) -> None:
        """When this worker has not confirmed its leases for a while (it stalled), make sure the
        attempt still holds the run before more of it goes out; a store that does not answer
        cannot tell, and the events go on (an outage is not a lost run)."""
        if not self.must_confirm():
            return  # confirmed lately, or the last check could not tell (an outage): the bus goes on
        with contextlib.suppress(AttemptLostError):  # marked lost: the publisher stops sending
            try:
                await self.check_held()
            except AttemptLostError:
                raise
            except Exception as exc:
                self._confirm_after = time.monotonic() + CONFIRM_BACKOFF_S
                if not self.failing:  # an outage says so once, from the saves
                    log.warning(
                        "could not confirm that the attempt holds its run", extra={"error": repr(exc)}
                    )

    async def _store_loop(self) -> None:
        try:
            await self._store_forever()
        except Exception as exc:
            log.exception("event persister crashed", extra=self._context)
            self.error = EventPersistError(f"event persister of run {self.run_id} crashed: {exc!r}")
            self.dead = True
            self._saving = False
            self._queued.clear()
            self._progressed()

    async def _store_forever(self) -> None:
        while True:
            if not self._queued:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._interval_s and not self._urgent() and self._stored_any:
                # Let a larger batch build up: database writes cost far more than Redis appends.
                # Not for the run's first events: a reader whose cursor the bus does not hold
                # waits for the database to reach the bus's first event (app.streaming.resume).
                # flush() and done end the wait early. Every run's wait ends on the process's
                # grid (``next_tick``), so their saves commit together.
                loop = asyncio.get_running_loop()
                timer = self._timer = loop.create_future()
                handle = loop.call_at(next_tick(loop.time(), self._interval_s), _resolve, timer)
                try:
                    await timer
                finally:
                    handle.cancel()
                    self._timer = None
            self._saving = True
            try:
                await self._save(self._queued[: self._batch])
            finally:
                self._saving = False
                self._stored_any = True
            self._progressed()

    async def _save(self, batch: list[StoredEvent | CheckpointRecord]) -> None:
        events = [item for item in batch if type(item) is StoredEvent]
        records = [item for item in batch if type(item) is CheckpointRecord]
        if self.checkpoints_lost:
            # A delta after a lost checkpoint would fold onto a state that lacks what was lost:
            # until a whole-state checkpoint is stored, the stored ones stop where the loss began
            # (a new attempt would start from there, as after any crash).
            first_full = next((i for i, c in enumerate(records) if c.full), len(records))
            records = records[first_full:]
        checkpoints = _merged(records)
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                if self._fence is not None and (
                    self._unconfirmed() or any(c.follow_ups_through is not None for c in checkpoints)
                ):
                    # Taking follow-ups off the queue is for the attempt that holds the run only: a
                    # stalled one must not delete what its successor is still to take. And a
                    # worker that has not confirmed its leases for a while may have lost the run.
                    asked_at = time.monotonic()
                    await self._store.save(self.conversation_id, events, checkpoints, self._fence)
                    self._held_at = asked_at  # the fenced save renewed the lease
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
                permanent = isinstance(exc, self._permanent_errors)
                if permanent:
                    self.error = EventPersistError(f"events of run {self.run_id} refused: {exc}")
                    log.info(
                        "event store refuses this run's events for good; they are not persisted",
                        extra={**self._context, "error": str(exc)},
                    )
                    self.dead = True
                    self._queued.clear()
                    self._progressed()
                    # Stay parked: flush() reports the error; nothing more can be saved.
                    await asyncio.Event().wait()
                if self.down or now - first_failure > self._retry_s:
                    # Past the retry budget (or the store is known to be down): this batch is lost
                    # to the log (its clients had it from the bus), and flush()/close() will say
                    # so; the following batches get one attempt each until the store answers.
                    if self.error is None:
                        self.error = EventPersistError(
                            f"could not store some events of run {self.run_id} "
                            f"(tried for {self._retry_s:.0f}s): {exc}"
                        )
                    if not self.down:
                        log.error(
                            "event store unusable; events are not persisted until it answers",
                            extra={**self._context, "error": str(exc)},
                        )
                    self.down = True
                    self.failing = True
                    self.dropped += 1
                    if checkpoints:
                        self.checkpoints_lost = True
                    del self._queued[: len(batch)]
                    return
                log.warning(
                    "event store save failed; retrying",
                    extra={**self._context, "error": str(exc)},
                )
                if not self.failing:
                    self.failing = True
                    self._wake_waiters()
                await asyncio.sleep(backoff(attempt, 2.0))
                attempt += 1
                continue
            self.failing = False
            if self.down:
                log.info("event store answers again", extra=self._context)
                self.down = False
            if any(c.full for c in checkpoints):
                self.checkpoints_lost = False
            del self._queued[: len(batch)]
            return
