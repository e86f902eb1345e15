"""RunPublisher for an attempt of a run (RUNS.md R-03, R-05): ``stored()`` vouches that what was
checkpointed is stored by the attempt that holds the run; once the store says the attempt lost its
run, nothing more of it goes anywhere. After the store dropped checkpoints, ``stored()`` fails until
a whole-state one is stored (and the run's checkpointer asks for one); while the worker's leases are
unconfirmed for over half a lease, every save is fenced and the bus waits for the check."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, cast

import orjson
import pytest

from app.engine.events import IterationStarted, ThinkingStarted
from app.observability import Metrics
from app.runs.execution import RunCheckpointer
from app.streaming.bus import StoredEvent
from app.streaming.publisher import RunPublisher
from app.streaming.store import AttemptLostError, CheckpointRecord, EventPersistError, Fence, HoldClock
from tests.unit.streaming.doubles import ScriptedBus, wait_until

pytestmark = pytest.mark.usefixtures("bus_path")

CONV, RUN = "conv_1", "run_1"
FENCE = Fence(RUN, 1, "w1", 30)


class FencedStore:
    """Keeps what an attempt saves while it holds the run; ``lost`` ends that, ``down`` fails saves."""

    def __init__(self) -> None:
        self.events: list[StoredEvent] = []
        self.checkpoints: list[CheckpointRecord] = []
        self.fences: list[Fence | None] = []
        self.lost = False
        self.down = 0

    async def save(
        self,
        conversation_id: str,
        events: Sequence[StoredEvent],
        checkpoints: Sequence[CheckpointRecord] = (),
        fence: Fence | None = None,
    ) -> None:
        self.fences.append(fence)
        if self.down:
            self.down -= 1
            raise ConnectionError("database is down")
        if self.lost:
            raise AttemptLostError("another attempt holds the run")
        self.events += [e for e in events if e not in self.events]
        self.checkpoints += list(checkpoints)

    async def holds_run(self, fence: Fence) -> bool:
        self.fences.append(fence)
        return not self.lost


async def test_an_attempt_that_lost_its_run_stops_publishing_and_says_so() -> None:
    bus, store = ScriptedBus(), FencedStore()
    told: list[str] = []
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE, on_lost=lambda: told.append("lost"))
    await pub.publish(ThinkingStarted(1))
    pub.checkpoint(CheckpointRecord(RUN, 1, 0, "{}"))
    await pub.stored()
    assert store.fences[-1] == FENCE  # the barrier asked whether the attempt holds the run
    on_bus = len(await bus.read_after(CONV, "0-0"))

    store.lost = True
    await pub.publish(IterationStarted(1, "calc", {}))
    pub.checkpoint(CheckpointRecord(RUN, 1, 1, "{}"))
    with pytest.raises(AttemptLostError):
        await pub.stored()  # a tool that must not run twice does not start
    await wait_until(lambda: told == ["lost"])

    await pub.publish(ThinkingStarted(2))  # queued, but nothing goes out any more
    with pytest.raises(AttemptLostError):
        await pub.flush_store()
    await pub.discard()
    assert len(store.checkpoints) == 1
    assert len(await bus.read_after(CONV, "0-0")) <= on_bus + 1  # at most what was in flight


async def test_stored_vouches_for_what_was_checkpointed_since_even_after_an_earlier_loss() -> None:
    bus, store = ScriptedBus(), FencedStore()
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE, store_retry_s=0.0)
    store.down = 2  # the first batch is given up (failed again past its retry budget)
    await pub.publish(ThinkingStarted(1))
    with pytest.raises(EventPersistError):
        await pub.stored()

    pub.checkpoint(CheckpointRecord(RUN, 1, 0, "{}"))
    await pub.stored()  # this checkpoint is stored: the earlier loss does not make it fail
    with pytest.raises(EventPersistError):
        await pub.flush_store()  # the run's log still misses that first batch, and says so
    assert [c.seq for c in store.checkpoints] == [0]
    await pub.discard()


async def test_only_a_checkpoint_that_takes_follow_ups_is_fenced() -> None:
    bus, store = ScriptedBus(), FencedStore()
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE)
    pub.checkpoint(CheckpointRecord(RUN, 1, 0, "{}"))
    await pub.flush_store()
    pub.checkpoint(CheckpointRecord(RUN, 1, 1, "{}", follow_ups_through=7))
    await pub.flush_store()
    assert store.fences == [None, FENCE]
    await pub.discard()


# ---- checkpoints the store lost ------------------------------------------------------------------


async def test_after_a_batch_of_checkpoints_is_dropped_stored_fails_until_a_whole_state_one_is_stored() -> (
    None
):
    bus, store = ScriptedBus(), FencedStore()
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE, store_retry_s=0.0)
    assert not pub.checkpoints_lost
    store.down = 2  # the batch fails again past its retry budget: given up
    pub.checkpoint(CheckpointRecord(RUN, 1, 0, '{"v":[0]}'))
    with pytest.raises(EventPersistError):
        await pub.stored()
    assert pub.checkpoints_lost and store.checkpoints == []

    # A checkpoint of what changed since would not fold onto what is stored: it is not stored
    # (the stored ones stop where the loss began, as after a crash).
    pub.checkpoint(CheckpointRecord(RUN, 1, 1, '{"v":[1]}'))
    with pytest.raises(EventPersistError):
        await pub.stored()
    assert store.checkpoints == [] and pub.checkpoints_lost

    pub.checkpoint(CheckpointRecord(RUN, 1, 2, '{"v":[2],"full":1}', full=True))
    pub.checkpoint(CheckpointRecord(RUN, 1, 3, '{"v":[3]}'))
    await pub.stored()
    assert not pub.checkpoints_lost
    assert [(c.seq, c.full) for c in store.checkpoints] == [(3, True)]  # the full one and the next, one row
    await pub.discard()


async def test_a_dropped_batch_without_checkpoints_loses_no_checkpoint() -> None:
    bus, store = ScriptedBus(), FencedStore()
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE, store_retry_s=0.0)
    store.down = 2
    await pub.publish(ThinkingStarted(1))
    with pytest.raises(EventPersistError):
        await pub.stored()
    assert not pub.checkpoints_lost

    pub.checkpoint(CheckpointRecord(RUN, 1, 0, '{"v":[0]}'))
    await pub.stored()  # no whole-state checkpoint needed
    assert [c.seq for c in store.checkpoints] == [0]
    await pub.discard()


class Queue:
    """The follow-up queue as the checkpointer sees it: how far the run took it."""

    def __init__(self, position: int | None) -> None:
        self.position = position


async def test_the_run_checkpointer_asks_for_a_whole_state_checkpoint_and_it_takes_the_follow_ups_again() -> (
    None
):
    bus, store = ScriptedBus(), FencedStore()
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE, store_retry_s=0.0)
    queue = Queue(position=7)  # what the run's start took already
    metrics = Metrics()
    checkpointer = RunCheckpointer(pub, cast(Any, queue), RUN, 1, metrics, first_seq=0)

    checkpointer.record({"v": [0]})
    await checkpointer.durable()
    assert not checkpointer.wants_full()
    queue.position = 9  # a drain took follow-ups 8 and 9: they leave the queue with this checkpoint
    store.down = 2
    checkpointer.record({"v": [1], "f": ["later"]})
    with pytest.raises(EventPersistError):
        await checkpointer.durable()
    assert checkpointer.wants_full()

    checkpointer.record({"v": [1], "f": ["later"], "full": 1})
    await checkpointer.durable()
    assert not checkpointer.wants_full()
    assert [(c.seq, c.full, c.follow_ups_through) for c in store.checkpoints] == [
        (0, False, None),
        (2, True, 9),
    ]
    assert orjson.loads(store.checkpoints[-1].data) == {"v": [1], "f": ["later"], "full": 1}
    assert store.fences[-1] == FENCE  # taking follow-ups is fenced
    assert metrics.registry.get_sample_value("agentstream_checkpoints_total") == 3
    await pub.discard()


async def test_a_whole_state_checkpoint_of_a_run_that_took_no_follow_ups_takes_none() -> None:
    bus, store = ScriptedBus(), FencedStore()
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=FENCE)
    checkpointer = RunCheckpointer(pub, cast(Any, Queue(position=None)), RUN, 1, Metrics(), first_seq=1)
    checkpointer.record({"v": [0], "full": 1})
    await checkpointer.durable()
    assert [(c.seq, c.full, c.follow_ups_through) for c in store.checkpoints] == [(1, True, None)]
    await pub.discard()


# ---- a worker whose leases are unconfirmed -------------------------------------------------------


def stale_clock(lease_s: float = 30) -> HoldClock:
    """A heartbeat that last confirmed the worker's leases more than half a lease ago."""
    clock = HoldClock()
    clock.confirmed_at = time.monotonic() - lease_s / 2 - 1
    return clock


def test_a_fence_is_stale_once_its_leases_are_unconfirmed_for_more_than_half_a_lease() -> None:
    clock = HoldClock()
    fence = Fence(RUN, 1, "w1", 30, hold=clock)
    assert not fence.stale()
    clock.confirm(time.monotonic() - 16)  # an older confirmation does not move it back
    assert not fence.stale()
    clock.confirmed_at = time.monotonic() - 16
    assert fence.stale() and not Fence(RUN, 1, "w1", 40, hold=clock).stale()
    clock.confirm(time.monotonic())
    assert not fence.stale()
    assert not Fence(RUN, 1, "w1", 30).stale()  # no clock: never stale


async def test_while_the_fence_is_stale_the_attempt_confirms_its_hold_with_a_fenced_save() -> None:
    bus, store = ScriptedBus(), FencedStore()
    clock = stale_clock()
    stale = Fence(RUN, 1, "w1", 30, hold=clock)
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=stale)
    await pub.publish(ThinkingStarted(1))
    pub.checkpoint(CheckpointRecord(RUN, 1, 0, "{}"))
    await pub.flush_store()
    assert store.fences[:1] == [stale], store.fences

    # That save confirmed the hold (and renewed the lease) for half a lease: no fence meanwhile.
    saves = len(store.fences)
    await pub.publish(ThinkingStarted(2))
    await pub.flush_store()
    assert store.fences[saves:] == [None]

    pub._writer._held_at -= 16  # half a lease later, still no heartbeat: fenced again
    saves = len(store.fences)
    await pub.publish(ThinkingStarted(3))
    await pub.flush_store()
    assert store.fences[saves : saves + 1] == [stale]  # the first save confirms it again

    pub._writer._held_at -= 16
    clock.confirm(time.monotonic())  # the heartbeat confirmed the leases: back to the cheap saves
    saves = len(store.fences)
    await pub.publish(ThinkingStarted(4))
    await pub.flush_store()
    assert store.fences[saves:] == [None]
    await pub.discard()


class HangingStore(FencedStore):
    """Saves never answer; ``holds_run`` says whether the attempt holds the run (or fails)."""

    def __init__(self, holds: bool | None) -> None:
        super().__init__()
        self.holds = holds
        self.asked = 0

    async def save(
        self,
        conversation_id: str,
        events: Sequence[StoredEvent],
        checkpoints: Sequence[CheckpointRecord] = (),
        fence: Fence | None = None,
    ) -> None:
        await asyncio.Event().wait()

    async def holds_run(self, fence: Fence) -> bool:
        self.asked += 1
        if self.holds is None:
            raise ConnectionError("database is down")
        return self.holds


async def test_a_stale_attempt_that_lost_its_run_sends_nothing_to_the_bus() -> None:
    bus, store = ScriptedBus(), HangingStore(holds=False)
    told: list[str] = []
    stale = Fence(RUN, 1, "w1", 30, hold=stale_clock())
    pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=stale, on_lost=lambda: told.append("lost"))
    await pub.publish(ThinkingStarted(1))
    await wait_until(lambda: told == ["lost"])
    assert await bus.read_after(CONV, "0-0") == []
    with pytest.raises(AttemptLostError):
        await pub.flush()
    await pub.discard()


async def test_a_fresh_attempt_or_a_store_that_cannot_tell_sends_to_the_bus_as_before() -> None:
    for fence, holds in (
        (Fence(RUN, 1, "w1", 30, hold=HoldClock()), False),
        (
            Fence(RUN, 1, "w1", 30, hold=stale_clock()),
            None,
        ),
    ):
        bus, store = ScriptedBus(), HangingStore(holds=holds)
        pub = RunPublisher(bus, store, CONV, RUN, last_id=None, fence=fence)
        await pub.publish(ThinkingStarted(1))
        await wait_until(lambda: len(bus.appends) == 1)  # noqa: B023
        assert store.asked == (0 if holds is False else 1)
        await pub.discard()
