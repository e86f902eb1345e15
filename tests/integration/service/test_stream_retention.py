"""Events Redis no longer holds (expired after retention, or lost) are served from the database.

A real uvicorn serves the app in a thread on the real Redis; "Redis restarted empty" is simulated by
deleting the conversation's stream key.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    gated_llm_fixture,
    redis_client,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.server import ServerThread, wait_until

pytestmark = [pytest.mark.timeout(30), pytest.mark.redis]

DATABASES = pytest.mark.parametrize(
    "database_backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)


def stream_key(prefix: str, conversation_id: str) -> str:
    return f"{prefix}:events:{conversation_id}"


@DATABASES
def test_a_cursor_older_than_the_redis_retention_is_served_from_the_database_then_live(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    redis_prefix: str,
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=30, delay_s=0.002))
    api = clients(start_service(stream_retention_s=1).base_url)
    conv = api.create_conversation()
    first_id = api.start_run(conv, "first")
    with api.stream(conv) as stream:
        live = stream.read()
    first = api.wait_stored(first_id)
    assert as_stored(live) == first

    redis = redis_client()
    try:
        assert redis.exists(stream_key(redis_prefix, conv))
        wait_until(
            lambda: not redis.exists(stream_key(redis_prefix, conv)),
            timeout=10,
            interval=0.05,
            what="the stream to expire in Redis",
        )
    finally:
        redis.close()

    with api.stream(conv, last_event_id=first[2]["id"]) as stream:
        replayed = stream.read()
    assert [(e.id, e.raw_data) for e in replayed] == [(e.id, e.raw_data) for e in live[3:]]

    # A new run fills Redis again from a later id: the old cursor gets the rest of the first
    # run from the database (the stream ends at its done), and its reconnect the second run.
    agent.close_gate()
    second_id = api.start_run(conv, "second")
    with api.stream(conv, last_event_id=first[2]["id"]) as stream:
        caught_up = stream.read()
    with api.stream(conv, last_event_id=caught_up[-1].id) as stream:
        opening = stream.read(count=1)
        agent.gate.set()
        caught_up += opening + stream.read()
    assert as_stored(caught_up) == first[3:] + api.wait_stored(second_id)


@DATABASES
def test_events_lost_by_redis_mid_run_are_served_from_the_database_without_a_gap(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[[str], Api],
    redis_prefix: str,
) -> None:
    gated_llm.play(GatedAgent(tokens=150, delay_s=0.01))
    api = clients(start_service().base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv, "a long answer")
    redis = redis_client()
    try:
        with api.stream(conv) as watcher:
            live = watcher.read(count=20)
            assert live[-1].event == "answer"
            # Redis "restarts empty": everything it held of the conversation is gone.
            assert redis.delete(stream_key(redis_prefix, conv)) == 1
            with api.stream(conv, last_event_id=live[4].id) as late:
                resumed = late.read(count=40)
                live += watcher.read()
                resumed += late.read()
    finally:
        redis.close()
    stored = api.wait_stored(run_id)
    assert as_stored(live) == stored
    assert as_stored(resumed) == stored[5:]
    assert stored[-1]["data"]["status"] == "completed"
