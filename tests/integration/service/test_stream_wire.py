"""What the event stream looks like on the wire: headers, pings, its end, and events equal everywhere.

A real uvicorn serves the app in a thread; clients read SSE through httpx.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    BUSES,
    STACKS,
    Api,
    FakeLLM,
    GatedAgent,
    answer_of,
    as_stored,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.server import ServerThread

pytestmark = pytest.mark.timeout(30)


@BUSES
def test_a_quiet_stream_sends_pings_has_sse_headers_and_ends_after_done(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=10))
    api = clients(start_service(redis=redis_bus, sse_ping_seconds=0.2).base_url)
    conv = api.create_conversation()
    agent.close_gate()
    run_id = api.start_run(conv)

    with api.stream(conv) as stream:
        headers = stream.response.headers
        assert headers["content-type"].startswith("text/event-stream")
        assert headers["cache-control"] == "no-cache"
        assert headers["x-accel-buffering"] == "no"
        # The run waits on the model: only pings flow (the events before the model call first).
        events = stream.read(until=lambda e: e.event == "step" and e.data.get("type") == "thinking")
        assert [e.event for e in events][-1] == "step"
        assert stream.read_comments(3) == [": ping"] * 3
        agent.gate.set()
        events += stream.read(until=lambda e: e.event == "done")
        assert events[-1].event == "done"
        assert stream.ends_within(3.0), "the server kept the stream open after done"
    assert as_stored(events) == api.wait_stored(run_id)


@STACKS
def test_an_event_is_the_same_live_replayed_and_from_the_runs_events(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=60, delay_s=0.002))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv, "say something long")
    with api.stream(conv) as stream:
        live = stream.read()
    with api.stream(conv, after="0-0") as stream:
        replayed = stream.read()
    stored = api.wait_stored(run_id)

    assert [(e.id, e.event, e.raw_data) for e in live] == [(e.id, e.event, e.raw_data) for e in replayed]
    assert as_stored(live) == stored
    assert all(e.data["run_id"] == run_id for e in live)
    done = live[-1].data
    assert done["status"] == "completed"
    assert answer_of(stored) == done["answer"] == agent.answer
    assert api.run(run_id)["answer"] == done["answer"]


@BUSES
def test_a_run_cancelled_mid_answer_ends_with_a_done_whose_answer_is_the_deltas_sent(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
) -> None:
    gated_llm.play(GatedAgent(tokens=300, delay_s=0.01))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv, "a long answer")
    with api.stream(conv) as stream:
        events = stream.read(until=lambda e: e.event == "answer" and e.data.get("status") == "delta")
        assert api.cancel(conv).status_code == 202
        events += stream.read()
    done = events[-1].data
    assert done["status"] == "cancelled"
    assert done["answer"], "the cancel should have landed mid-answer"
    assert answer_of(as_stored(events)) == done["answer"]
    assert api.run(run_id)["answer"] == done["answer"]
    assert as_stored(events) == api.wait_stored(run_id)
