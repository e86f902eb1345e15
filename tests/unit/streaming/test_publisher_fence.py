"""RunPublisher for an attempt of a run (RUNS.md R-03, R-05): ``stored()`` vouches that what was
checkpointed is stored by the attempt that holds the run; once the store says the attempt lost its
run, nothing more of it goes anywhere."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from app.engine.events import IterationStarted, ThinkingStarted
from app.streaming.bus import StoredEvent
from app.streaming.publisher import RunPublisher
from app.streaming.store import AttemptLostError, CheckpointRecord, EventPersistError, Fence
from tests.unit.streaming.doubles import ScriptedBus, wait_until

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
