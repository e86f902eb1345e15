"""RunPublisher: one encoding per event, increasing ids, delta coalescing, batching, retries, close."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Sequence

import orjson
import pytest

from app.engine.events import (
    AnswerDelta,
    AnswerStarted,
    IterationDone,
    IterationStarted,
    RunDone,
    ThinkingStarted,
)
from app.streaming.bus import StoredEvent, parse_cursor
from app.streaming.publisher import MAX_DELTA_CHARS, RunPublisher
from app.streaming.store import EventPersistError, PublisherClosedError
from app.streaming.store_writer import next_tick
from tests.unit.streaming.doubles import MemoryStore, ScriptedBus, wait_until

pytestmark = pytest.mark.usefixtures("bus_path")

CONV = "conv_1"
RUN = "run_1"


def run_done(answer: str = "ok") -> RunDone:
    return RunDone(answer=answer, iterations=1, usage={"total_tokens": 3}, elapsed=0.5, status="completed")


def publisher(bus: ScriptedBus, store: MemoryStore, **kw: object) -> RunPublisher:
    kw.setdefault("last_id", None)
    return RunPublisher(bus, store, CONV, RUN, **kw)  # type: ignore[arg-type]


def ids_increase(events: list[StoredEvent]) -> bool:
    keys = [parse_cursor(e.id) for e in events]
    return all(a < b for a, b in itertools.pairwise(keys))


async def test_event_data_is_the_engine_payload_plus_run_id_encoded_once() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store)
    event = IterationDone(
        iteration=1, tool_name="calc", observation="line1\nline2", error=None, iter_elapsed=0.1
    )
    returned = await pub.publish(event)
    await pub.publish(run_done())
    await pub.close()

    on_bus = await bus.read_after(CONV, "0-0")
    assert returned is not None and on_bus[0] == returned
    assert orjson.loads(on_bus[0].data) == {**event.data(), "run_id": RUN}
    assert on_bus[0].event == "step" and on_bus[0].run_id == RUN
    assert on_bus[1].event == "done" and orjson.loads(on_bus[1].data)["run_id"] == RUN
    assert store.all(CONV) == on_bus  # the same id and the same bytes in both places


async def test_deltas_published_while_a_send_is_in_flight_merge_into_one_exact_delta() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store)
    await pub.publish(AnswerStarted())
    await wait_until(bus.in_append.is_set)  # the first send is now in flight, held at the gate
    tokens = ["Hel", "lo", ", ", "wörld", "\n", '"quoted"', "\r\n", "\x00", " 😀", ""]
    for token in tokens:
        assert await pub.publish(AnswerDelta(token)) is None
    bus.gate.set()
    await pub.publish(run_done("".join(tokens)))
    await pub.close()

    events = await bus.read_after(CONV, "0-0")
    assert [e.event for e in events] == ["answer", "answer", "done"]
    delta = orjson.loads(events[1].data)
    assert delta == {"status": "delta", "content": "".join(tokens), "run_id": RUN}
    assert len(bus.appends) == 2  # start alone, then the merged delta together with done
    assert ids_increase(events)


async def test_with_a_linger_slow_tokens_wait_for_the_next_and_anything_else_ends_the_wait() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    # Every token comes "slowly" (coalesce 0), and would go out alone but for the linger.
    pub = publisher(bus, store, coalesce_ms=0, linger_ms=60_000)
    await pub.publish(AnswerStarted())
    await wait_until(lambda: len(bus.appends) == 1)
    await pub.publish(AnswerDelta("a"))
    for _ in range(20):  # the send loop gets every chance to send it, and holds it
        await asyncio.sleep(0)
    assert len(bus.appends) == 1
    await pub.publish(AnswerDelta("b"))
    await asyncio.wait_for(pub.flush(), timeout=5)  # a flush does not wait out the linger
    await pub.publish(AnswerDelta("c"))
    await pub.publish(AnswerDelta("d"))
    await asyncio.wait_for(pub.publish(run_done("abcd")), timeout=5)
    await asyncio.wait_for(pub.close(), timeout=5)  # nor does the done

    events = await bus.read_after(CONV, "0-0")
    contents = [orjson.loads(e.data).get("content") for e in events]
    assert contents == [None, "ab", "cd", None]
    assert [e.event for e in store.all(CONV)] == [e.event for e in events]


async def test_with_a_linger_no_other_event_and_nothing_stored_waits_for_it() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, coalesce_ms=0, linger_ms=60_000)
    await pub.publish(ThinkingStarted(iteration=1))
    await pub.publish(AnswerDelta("a"))  # queued right behind the step: the step must not wait

    await wait_until(lambda: len(bus.appends) == 1)
    assert [e.event for e in bus.appends[0]] == ["step", "answer"]
    await pub.publish(AnswerDelta("b"))
    await asyncio.wait_for(pub.flush_store(), timeout=5)  # stored now: the bus gets it now too
    await wait_until(lambda: len(bus.appends) == 2)
    assert [orjson.loads(e.data)["content"] for e in bus.appends[1]] == ["b"]
    await pub.publish(run_done("ab"))
    await asyncio.wait_for(pub.close(), timeout=5)


async def test_merged_deltas_stop_growing_at_the_size_cap() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store)
    await pub.publish(AnswerStarted())
    await wait_until(bus.in_append.is_set)
    tokens = [f"{n:07d} " for n in range(10_000)]  # 80,000 characters while the send is held
    for token in tokens:
        await pub.publish(AnswerDelta(token))
    bus.gate.set()
    await pub.publish(run_done("".join(tokens)))
    await pub.close()

    answer = [orjson.loads(e.data) for e in await bus.read_after(CONV, "0-0") if e.event == "answer"]
    deltas = [a["content"] for a in answer if a["status"] == "delta"]
    assert "".join(deltas) == "".join(tokens)
    assert len(deltas) == 5 and max(len(d) for d in deltas) <= MAX_DELTA_CHARS + 8


async def test_a_non_delta_event_ends_a_merge_so_order_is_kept() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store)
    await pub.publish(AnswerStarted())
    await wait_until(bus.in_append.is_set)
    await pub.publish(AnswerDelta("a"))
    await pub.publish(AnswerDelta("b"))
    await pub.publish(ThinkingStarted(iteration=2))
    await pub.publish(AnswerDelta("c"))
    bus.gate.set()
    await pub.publish(run_done())
    await pub.close()

    events = await bus.read_after(CONV, "0-0")
    contents = [orjson.loads(e.data).get("content") for e in events]
    assert contents == [None, "ab", None, "c", None]


async def test_ids_keep_increasing_when_the_clock_stands_still_or_goes_back() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    times = iter([5000, 5000, 5000, 4000, 10, 5001, 5001, 3000, 6000, 6000])
    pub = publisher(bus, store, last_id="5000-7", clock_ms=lambda: next(times))
    for i in range(9):
        await pub.publish(ThinkingStarted(iteration=i))
    await pub.publish(run_done())
    await pub.close()

    events = await bus.read_after(CONV, "0-0")
    assert len(events) == 10
    assert parse_cursor(events[0].id) > (5000, 7)
    assert ids_increase(events)
    assert [e.id for e in events][:4] == ["5000-8", "5000-9", "5000-10", "5000-11"]


async def test_a_quiet_bus_gets_each_event_as_it_comes() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, coalesce_ms=0)
    for i in range(3):
        await pub.publish(ThinkingStarted(iteration=i))
        await wait_until(lambda i=i: len(bus.appends) == i + 1)
    await pub.close()
    assert [len(batch) for batch in bus.appends] == [1, 1, 1]


async def test_events_published_during_a_send_go_out_together_in_the_next_batch() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store)
    await pub.publish(ThinkingStarted(iteration=0))
    await wait_until(bus.in_append.is_set)
    for i in range(1, 51):
        await pub.publish(ThinkingStarted(iteration=i))
    bus.gate.set()
    await pub.flush()
    assert [len(batch) for batch in bus.appends] == [1, 50]
    await pub.close()


async def test_store_outage_is_buffered_and_retried_without_storing_twice() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    store.fail_saves = 4
    pub = publisher(bus, store, store_interval_ms=0)
    for i in range(20):
        await pub.publish(ThinkingStarted(iteration=i))
        await asyncio.sleep(0)
    await pub.publish(run_done())
    await pub.close()

    on_bus = await bus.read_after(CONV, "0-0")
    assert store.failed_saves == 4
    assert store.all(CONV) == on_bus and len(on_bus) == 21
    every_saved = [i for batch in store.saved_batches for i in batch]
    assert sorted(every_saved) == sorted(e.id for e in on_bus)  # none stored twice, none missing


async def test_the_bus_gets_events_while_the_store_is_down() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    store.fail_saves = 10**9
    pub = publisher(bus, store, store_retry_s=60)
    await pub.publish(ThinkingStarted(iteration=1))
    await wait_until(lambda: len(bus.appends) == 1)
    await wait_until(lambda: store.failed_saves >= 2)
    assert store.all(CONV) == []
    store.fail_saves = 0
    await pub.publish(run_done())
    await pub.close()
    assert [e.event for e in store.all(CONV)] == ["step", "done"]


async def test_close_raises_when_the_store_stays_down_past_its_retry_budget() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    store.fail_saves = 10**9
    pub = publisher(bus, store, store_retry_s=0.05)
    await pub.publish(run_done())
    with pytest.raises(EventPersistError):
        await pub.close()
    assert (await bus.last_id(CONV)) is not None  # the bus still got the done event
    assert bus.expired == [(CONV, 600)]  # and the stream still expires


async def test_a_store_back_after_its_retry_budget_gets_the_rest_of_the_run() -> None:
    """An outage past the budget costs the log the batch that waited through it, not the rest of
    the run; close() still says that events are missing."""
    bus, store = ScriptedBus(), MemoryStore()
    store.fail_saves = 10**9
    pub = publisher(bus, store, store_retry_s=0.05)
    lost = await pub.publish(ThinkingStarted(iteration=1))
    with pytest.raises(EventPersistError):
        await pub.flush_store()
    store.fail_saves = 0

    kept = await pub.publish(ThinkingStarted(iteration=2))
    await pub.publish(run_done())
    with pytest.raises(EventPersistError):
        await asyncio.wait_for(pub.close(), timeout=5)

    assert lost is not None and kept is not None
    assert [e.id for e in store.all(CONV)][:1] == [kept.id] and store.all(CONV)[-1].event == "done"
    assert [e.event for e in await bus.read_after(CONV, "0-0")] == ["step", "step", "done"]


async def test_bus_outage_is_retried_in_order_and_a_half_applied_batch_is_not_duplicated() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store)
    await pub.publish(ThinkingStarted(iteration=0))
    await wait_until(bus.in_append.is_set)
    for i in range(1, 11):
        await pub.publish(ThinkingStarted(iteration=i))
    bus.fail_appends = 3
    bus.partial_failure = True
    bus.gate.set()
    await pub.publish(run_done())
    await pub.close()

    on_bus = await bus.read_after(CONV, "0-0")
    iterations = [orjson.loads(e.data).get("iteration") for e in on_bus]
    assert iterations == [*range(11), None]
    assert ids_increase(on_bus)
    assert store.all(CONV) == on_bus


async def test_a_bus_down_past_its_retry_budget_leaves_events_to_the_store_and_the_run_ends() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.fail_appends = 10**9
    pub = publisher(bus, store, bus_retry_s=0.05)
    await pub.publish(ThinkingStarted(iteration=1))
    await pub.publish(run_done())
    await asyncio.wait_for(pub.close(), timeout=5)  # the done's batch gets one attempt, not 0.05 s more
    assert [e.event for e in store.all(CONV)] == ["step", "done"]
    assert await bus.last_id(CONV) is None


async def test_once_the_bus_answers_again_later_events_reach_it_naming_the_ones_it_missed() -> None:
    """A bus given up for the rest of the run left its followers waiting for events only the
    database got; the next entry's ``prev`` shows them the gap instead."""
    bus, store = ScriptedBus(), MemoryStore()
    bus.fail_appends = 10**9
    pub = publisher(bus, store, bus_retry_s=0.05)
    missed = [await pub.publish(ThinkingStarted(iteration=n)) for n in (1, 2)]
    await pub.flush()  # both left to the store
    bus.fail_appends = 0

    later = await pub.publish(ThinkingStarted(iteration=3))
    await pub.publish(run_done())
    await pub.close()

    on_bus = await bus.read_after(CONV, "0-0")
    assert missed[-1] is not None and later is not None
    assert [e.id for e in on_bus][:1] == [later.id] and on_bus[0].prev == missed[-1].id
    assert on_bus[-1].event == "done"
    assert [e.event for e in store.all(CONV)] == ["step", "step", "step", "done"]


async def test_done_is_on_the_bus_and_in_the_store_when_close_returns() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, retention_s=42, store_interval_ms=10_000)
    await pub.publish(AnswerDelta("partial"))
    await pub.publish(run_done("partial"))
    await pub.close()
    assert (await bus.read_after(CONV, "0-0"))[-1].event == "done"
    assert store.all(CONV)[-1].event == "done"
    assert bus.expired == [(CONV, 42)]


async def test_flush_waits_for_bus_and_store_without_ending_the_run() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, store_interval_ms=10_000)
    await pub.publish(ThinkingStarted(iteration=1))
    await pub.flush()
    assert len(store.all(CONV)) == 1 and len(await bus.read_after(CONV, "0-0")) == 1
    await pub.publish(ThinkingStarted(iteration=2))
    await pub.close()
    assert len(store.all(CONV)) == 2
    assert bus.expired == []  # no done, no retention clock


async def test_arguments_json_cannot_hold_are_shown_as_text_not_a_crash() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store)
    stored = await pub.publish(IterationStarted(iteration=1, tool_name="t", tool_args={"s": {1}, 2: "two"}))
    await pub.close()
    assert stored is not None
    assert orjson.loads(stored.data)["tool_args"] == {"s": "{1}", "2": "two"}


async def test_publish_after_close_is_refused() -> None:
    pub = publisher(ScriptedBus(), MemoryStore())
    await pub.publish(run_done())
    await pub.close()
    with pytest.raises(PublisherClosedError):
        await pub.publish(ThinkingStarted(iteration=1))


async def test_on_published_sees_every_event_once() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    seen: list[StoredEvent] = []
    pub = publisher(bus, store, on_published=seen.extend)
    for i in range(30):
        await pub.publish(ThinkingStarted(iteration=i))
        if i % 7 == 0:
            await asyncio.sleep(0)
    await pub.publish(run_done())
    await pub.close()
    assert seen == await bus.read_after(CONV, "0-0")


async def test_each_event_names_the_one_before_it_starting_from_the_run_start_cursor() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, last_id="1700000000000-4", coalesce_ms=50)
    await pub.publish(AnswerStarted())
    for token in ("a", "b", "c"):  # merge into one delta: its prev is the event before the first
        await pub.publish(AnswerDelta(token))
    await pub.publish(run_done("abc"))
    await pub.close()
    on_bus = await bus.read_after(CONV, "0-0")
    deltas = [orjson.loads(e.data) for e in on_bus[1:-1]]
    assert "".join(d["content"] for d in deltas) == "abc" and len(deltas) < 3
    assert [e.prev for e in on_bus] == ["1700000000000-4", *[e.id for e in on_bus[:-1]]]


async def test_a_stamped_event_takes_the_next_id_and_publish_stored_sends_it_to_the_bus_only() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, last_id="5-0")
    step = await pub.publish(ThinkingStarted(iteration=1))
    await pub.flush()

    done = pub.stamp(run_done("42"))
    assert not (await bus.read_after(CONV, step.id if step else "0-0"))  # stamped, not sent
    await pub.publish_stored(done)
    await pub.close()

    assert step is not None and done.prev == step.id and parse_cursor(done.id) > parse_cursor(step.id)
    assert [e.id for e in await bus.read_after(CONV, "0-0")] == [step.id, done.id]
    assert store.all(CONV) == [step]  # the caller stored the done itself
    with pytest.raises(PublisherClosedError):
        pub.stamp(run_done())


async def test_flush_store_returns_once_everything_is_stored_while_a_bus_append_still_waits() -> None:
    """A run closes during a bus outage without waiting out the bus's retries: its events are
    stored (what is published while the first append hangs goes to the store at once)."""
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store)
    first = await pub.publish(ThinkingStarted(iteration=1))
    await wait_until(bus.in_append.is_set)  # held at the gate: Redis does not answer
    await pub.publish(AnswerStarted())
    await pub.publish(AnswerDelta("partial"))

    await asyncio.wait_for(pub.flush_store(), timeout=5)

    assert [e.event for e in store.all(CONV)] == ["step", "answer", "answer"]
    assert first is not None and await bus.read_after(CONV, "0-0") == []
    bus.gate.set()
    await pub.close()
    assert [e.id for e in await bus.read_after(CONV, "0-0")] == [e.id for e in store.all(CONV)]


async def test_a_closed_bus_is_not_retried_and_the_store_still_gets_everything() -> None:
    """At shutdown the bus is closed under runs still closing: retrying it for ``bus_retry_s``
    would only hold up the process's exit."""
    bus, store = ScriptedBus(), MemoryStore()
    pub = publisher(bus, store, bus_retry_s=30.0)
    await bus.close()

    await pub.publish(ThinkingStarted(iteration=1))
    await pub.publish(run_done())
    await asyncio.wait_for(pub.close(), timeout=2)

    assert [e.event for e in store.all(CONV)] == ["step", "done"]


async def test_a_bus_closed_while_an_append_waits_is_given_up_and_the_store_gets_the_rest() -> None:
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store, bus_retry_s=30.0)
    await pub.publish(ThinkingStarted(iteration=1))
    await wait_until(bus.in_append.is_set)  # the step's append waits at the gate
    await pub.publish(AnswerDelta("a"))  # behind it
    await bus.close()
    bus.gate.set()  # the append finds the bus closed

    await pub.publish(run_done("a"))
    await asyncio.wait_for(pub.close(), timeout=2)

    assert [e.event for e in store.all(CONV)] == ["step", "answer", "done"]
    # The step's append was the last one tried: nothing more went to a closed bus.
    assert [e.event for batch in bus.appends for e in batch] == ["step"]


async def test_an_attempt_that_loses_its_run_while_an_append_fails_sends_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("app.streaming.publisher.backoff", lambda attempt, cap: 0.0)
    store = MemoryStore()
    pub: RunPublisher | None = None

    class LosingBus(ScriptedBus):
        """The append fails, and meanwhile the store writer finds another attempt holds the run."""

        async def append(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
            try:
                await super().append(conversation_id, events)
            except Exception:
                assert pub is not None
                pub._lost()
                raise

    bus = LosingBus()
    bus.fail_appends = 1
    pub = publisher(bus, store)
    await pub.publish(ThinkingStarted(iteration=1))
    await asyncio.wait_for(pub.flush(), timeout=2)
    for _ in range(20):  # a retry (which must not come) gets every chance
        await asyncio.sleep(0)

    assert bus.fail_appends == 0  # it was tried once
    assert bus.appends == []  # and never again
    await pub.discard()


async def test_discard_drops_what_is_queued_and_sends_nothing_more() -> None:
    """A run another worker closed with its own done: nothing of this one may follow that done."""
    bus, store = ScriptedBus(), MemoryStore()
    bus.gate = asyncio.Event()
    pub = publisher(bus, store, store_interval_ms=10_000)
    await pub.publish(ThinkingStarted(iteration=1))
    await wait_until(bus.in_append.is_set)  # the first batch is in flight
    await pub.publish(ThinkingStarted(iteration=2))
    await pub.publish(AnswerDelta("stray"))

    await asyncio.wait_for(pub.discard(), timeout=2)
    bus.gate.set()
    await pub.close()  # a no-op now, as in the run manager's clean-up

    held = [orjson.loads(e.data).get("iteration") for e in await bus.read_after(CONV, "0-0")]
    assert held in ([], [1])
    assert all(orjson.loads(e.data).get("iteration") == 1 for e in store.all(CONV))
    with pytest.raises(PublisherClosedError):
        await pub.publish(ThinkingStarted(iteration=3))


def test_save_moments_are_one_grid_for_the_process() -> None:
    for now in (0.0, 12.3456, 1e6 + 0.1):
        tick = next_tick(now, 0.5)
        assert now < tick <= now + 0.5
        assert next_tick(tick - 0.499, 0.5) == pytest.approx(tick, rel=0, abs=1e-6)  # the same tick
        assert next_tick(tick, 0.5) == pytest.approx(tick + 0.5, rel=0, abs=1e-6)  # strictly after


def test_a_forked_process_has_save_moments_of_its_own() -> None:
    """Workers forked from one parent do not all write at once to a shared SQLite file."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its grid's first tick after 0, then out at once
        os.write(write, repr(next_tick(0.0, 1.0)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as child:
        assert float(child.read()) != next_tick(0.0, 1.0)


async def test_the_runs_later_batches_are_saved_together_on_the_process_grid() -> None:
    """Each run's first events are saved at once; later ones wait for the process's next save
    moment, the same for every run however their events are spread, so that the event store's
    group commit takes them in one transaction."""
    loop = asyncio.get_running_loop()
    saved_at: list[tuple[str, float]] = []

    class TimedStore(MemoryStore):
        async def save(self, conversation_id: str, events: Sequence[StoredEvent]) -> None:
            saved_at.append((conversation_id, loop.time()))
            await super().save(conversation_id, events)

    bus, store = ScriptedBus(), TimedStore()
    pubs = [
        RunPublisher(bus, store, f"conv_{i}", f"run_{i}", last_id=None, store_interval_ms=200)  # type: ignore[arg-type]
        for i in range(3)
    ]
    for pub in pubs:
        await pub.publish(ThinkingStarted(iteration=1))
    await wait_until(lambda: len(saved_at) == 3)
    for pub in pubs:
        # Spread in time: each run's wait begins at its own moment.
        await asyncio.sleep(0.040)
        await pub.publish(ThinkingStarted(iteration=2))
    await wait_until(lambda: len(saved_at) == 6)
    later = sorted(at for _, at in saved_at[3:])
    # Saves a tick releases run in one pass of the loop, a pause or not; without the grid each came
    # 200 ms after its own events, 40 ms after the one before. So: one group, or two (a tick fell
    # inside the 80 ms spread), a tick apart.
    groups = [[later[0]]]
    for at in later[1:]:
        if at - groups[-1][-1] > 0.010:
            groups.append([])
        groups[-1].append(at)
    assert len(groups) <= 2, later
    if len(groups) == 2:
        assert groups[1][0] - groups[0][-1] > 0.150, later
    assert sorted(conv for conv, _ in saved_at[3:]) == ["conv_0", "conv_1", "conv_2"]
    for i, pub in enumerate(pubs):
        await pub.close()
        assert len(store.all(f"conv_{i}")) == 2
