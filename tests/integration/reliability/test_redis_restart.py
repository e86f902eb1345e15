"""Redis restarted empty mid-run (API.md, "Many workers": what Redis lost is served from the database).

The service's bus is a private ``redis-server`` of this test (the machine's shared Redis is never
touched), killed while a run waits on the model and started again, empty, while the run is still
going. The service reconnects by itself: ``/readyz`` names the event bus while it is down, the
run's events keep reaching the database, a client that stays connected and one that reconnects
with ``Last-Event-ID`` (during the outage and after it) each get every event once, the run ends
with its ``done``, and the restarted Redis carries the next run.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.integration.reliability.conftest import FaultyModel, ServiceLog
from tests.integration.service.workers_support import Api, SseEvent, answer_of, as_stored, thinking
from tests.support import redis_server
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.redis_server import PrivateRedis
from tests.support.server import ServerThread, wait_until
from tests.support.services import unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(60),
    pytest.mark.parametrize("database_backend", ["sqlite"]),
]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if not redis_server.available():
        unavailable("redis-server is not installed")
    with PrivateRedis(tmp_path / "redis") as server:
        yield server


def readiness(api: Api) -> tuple[int, dict[str, Any]]:
    response = api.http.get("/readyz")
    return response.status_code, response.json()


def is_answer_start(event: SseEvent) -> bool:
    return event.event == "answer" and event.data.get("status") == "start"


def test_a_run_survives_redis_restarting_empty_and_every_client_gets_every_event_once(
    private_redis: PrivateRedis,
    start_faulty_service: Callable[..., ServerThread],
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    service_log: ServiceLog,
    figures: Callable[[str, str], None],
) -> None:
    _, model = faulty_llm
    model.answer_with(60, delay_s=0.005)
    prefix = f"agentstream-test:reliability-{secrets.token_hex(4)}"
    server = start_faulty_service(redis_url=private_redis.url, redis_key_prefix=prefix)
    api = Api(server.base_url)
    try:
        assert readiness(api)[0] == 200
        conv = api.create_conversation()
        model.loop_gate.clear()
        model.stream_gate.clear()
        run_id = api.start_run(conv, "a question asked just before Redis dies")

        with api.stream(conv) as live:
            # Client A stays connected from start to done; client B hangs up and reconnects.
            received = live.read(until=thinking)
            with api.stream(conv) as first:
                b_received = first.read(count=1)

            private_redis.stop()
            stopped = time.monotonic()
            _, body = wait_until(
                lambda: (r := readiness(api))[0] == 503 and r, timeout=10, what="/readyz to say 503"
            )
            noticed = time.monotonic() - stopped
            assert body["down"] == ["event_bus"], body
            assert body["checks"]["database"] == "ok", body
            # Follow-ups live in the database: one posted while Redis is down is accepted, and the
            # run takes it (it asks the database when the hint cannot be read). A new run starts.
            follow_up = api.interrupt(conv, "anything new?")
            assert follow_up.status_code == 202, follow_up.text
            other_conv = api.create_conversation()
            other_run = api.start_run(other_conv, "a run started while Redis is down")

            # The run goes on while Redis is down: its events reach the database.
            model.loop_gate.set()
            wait_until(
                lambda: any(e["event"] == "answer" for e in api.events(run_id)),
                timeout=15,
                what="the run's answer start in the database while Redis is down",
            )
            # B reconnects with its cursor during the outage: the database serves it.
            with api.stream(conv, last_event_id=b_received[-1].id) as during:
                b_received += during.read(until=is_answer_start)

            private_redis.start()
            restarted = time.monotonic()
            wait_until(lambda: readiness(api)[0] == 200, timeout=10, what="/readyz to say 200 again")
            recovered = time.monotonic() - restarted
            model.stream_gate.set()
            received += live.read()

        assert received[-1].event == "done"
        done = received[-1].data
        assert done["status"] == "completed", done
        assert done["answer"] == model.answer
        assert [e.data["content"] for e in received if e.event == "inject"] == ["anything new?"]
        with api.stream(conv, last_event_id=b_received[-1].id) as after:
            b_received += after.read()

        stored = api.wait_stored(run_id)
        assert as_stored(received) == stored
        assert as_stored(b_received) == stored
        assert answer_of(stored) == done["answer"]
        assert api.run(run_id)["status"] == "completed"

        with api.stream(other_conv) as stream:
            other = stream.read()
        assert other[-1].event == "done"
        assert other[-1].data["status"] == "completed", other[-1].data
        assert as_stored(other) == api.wait_stored(other_run)

        # Healthy again, on the restarted Redis: a new run completes and its events go through it.
        assert readiness(api)[0] == 200
        conv2 = api.create_conversation()
        run2 = api.start_run(conv2, "and now?")
        with api.stream(conv2) as stream:
            again = stream.read()
        assert again[-1].event == "done"
        assert again[-1].data["status"] == "completed"
        assert as_stored(again) == api.wait_stored(run2)
        client = redis.Redis.from_url(private_redis.url)
        try:
            assert client.xlen(f"{prefix}:events:{conv2}") == len(again)
        finally:
            client.close()

        assert service_log.problems() == [], service_log.text
        figures("redis restart: /readyz says 503 after", f"{noticed:.2f}s")
        figures("redis restart: /readyz says 200 again after", f"{recovered:.2f}s")
    finally:
        api.close()
