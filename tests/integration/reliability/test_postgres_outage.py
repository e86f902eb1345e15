"""PostgreSQL unavailable for a few seconds mid-run: events are buffered and stored once, none lost.

The service reaches PostgreSQL through a ``TcpProxy`` of this test, which the test cuts (every
connection reset, new ones refused) while a run works, then restores. Clients keep getting the
run's events live from the bus; the publisher retries the database; afterwards the run's stored
events are exactly those the clients received, each once, the run ends with its ``done``, and the
service answers ``/readyz`` and completes a new run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy.engine import make_url

from tests.integration.reliability.conftest import FaultyModel, ServiceLog
from tests.integration.service.workers_support import Api, SseEvent, answer_of, as_stored, thinking
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.server import ServerThread, wait_until
from tests.support.tcp_proxy import TcpProxy

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.timeout(60),
    pytest.mark.parametrize("database_backend", ["postgres"]),
]

OUTAGE_S = 3.0
"""How long PostgreSQL stays away (at least: the test also waits for the store to have failed)."""


@pytest.fixture
def proxy(migrated_database_url: str) -> Iterator[TcpProxy]:
    url = make_url(migrated_database_url)
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as tcp_proxy:
        yield tcp_proxy


@pytest.fixture
def proxied_url(migrated_database_url: str, proxy: TcpProxy) -> str:
    """``migrated_database_url`` through the proxy."""
    url = make_url(migrated_database_url).set(host="127.0.0.1", port=proxy.port)
    return url.render_as_string(hide_password=False)


def is_answer_start(event: SseEvent) -> bool:
    return event.event == "answer" and event.data.get("status") == "start"


def cut_for_a_while(proxy: TcpProxy, api: Api, service_log: ServiceLog, during: Callable[[], None]) -> float:
    """Cut PostgreSQL off for at least ``OUTAGE_S``; ``during()`` runs meanwhile. The outage's length."""
    failures_before = service_log.count("event store save failed")
    proxy.cut()
    cut_at = time.monotonic()
    ready = api.http.get("/readyz")
    assert ready.status_code == 503, ready.text
    assert ready.json()["down"] == ["database"], ready.text
    during()
    wait_until(
        lambda: (
            service_log.count("event store save failed") >= failures_before + 2
            and time.monotonic() - cut_at >= OUTAGE_S
        ),
        timeout=OUTAGE_S + 15,
        interval=0.05,
        what="the publisher to retry the database a few times",
    )
    proxy.restore()
    return time.monotonic() - cut_at


def assert_unavailable_not_broken(api: Api, conv: str, run_id: str) -> None:
    """While the database is away, routes that need it answer 503 (retry later), never 500."""
    calls = {
        "read the run": api.http.get(f"/api/runs/{run_id}"),
        "create a conversation": api.http.post("/api/conversations", json={}),
        "open the stream": api.http.get(f"/api/conversations/{conv}/stream"),
    }
    for what, response in calls.items():
        assert response.status_code == 503, f"{what}: {response.status_code} {response.text}"
        assert response.json()["error"]["code"] == "unavailable", response.text


def assert_healthy(api: Api, model: FaultyModel) -> None:
    wait_until(lambda: api.http.get("/readyz").status_code == 200, timeout=10, what="/readyz 200")
    conv = api.create_conversation()
    run_id = api.start_run(conv, "still there?")
    with api.stream(conv) as stream:
        received = stream.read()
    assert received[-1].event == "done"
    assert received[-1].data["status"] == "completed"
    assert received[-1].data["answer"] == model.answer
    assert as_stored(received) == api.wait_stored(run_id)


def assert_stored_once(received: list[SseEvent], stored: list[dict[str, object]]) -> None:
    ids = [e["id"] for e in stored]
    assert len(set(ids)) == len(ids), "an event was stored twice"
    assert as_stored(received) == stored, "the stored events differ from those the client received"


def test_postgres_cut_off_while_the_answer_streams_loses_and_repeats_no_event(
    proxy: TcpProxy,
    proxied_url: str,
    start_faulty_service: Callable[..., ServerThread],
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    service_log: ServiceLog,
    figures: Callable[[str, str], None],
) -> None:
    _, model = faulty_llm
    model.answer_with(80, delay_s=0.01)
    server = start_faulty_service(database_url=proxied_url, run_lease_s=2.0)
    api = Api(server.base_url)
    try:
        conv = api.create_conversation()
        model.loop_gate.clear()
        model.stream_gate.clear()
        run_id = api.start_run(conv, "a question asked just before the database goes away")
        with api.stream(conv) as live:
            received = live.read(until=thinking)

            def meanwhile() -> None:
                # The run goes on: the loop answers and synthesis starts, live from the bus.
                model.loop_gate.set()
                received.extend(live.read(until=is_answer_start))
                assert_unavailable_not_broken(api, conv, run_id)

            outage = cut_for_a_while(proxy, api, service_log, meanwhile)
            model.stream_gate.set()
            received += live.read()

        done = received[-1]
        assert done.event == "done"
        assert done.data["status"] == "completed", done.data
        assert done.data["answer"] == model.answer
        stored = api.wait_stored(run_id)
        assert_stored_once(received, stored)
        assert answer_of(stored) == model.answer
        assert api.run(run_id)["status"] == "completed"
        assert_healthy(api, model)
        assert service_log.problems() == [], service_log.text
        figures("postgres outage mid-answer: outage", f"{outage:.1f}s")
    finally:
        api.close()


def test_postgres_cut_off_when_the_run_ends_delays_its_done_until_the_database_is_back(
    proxy: TcpProxy,
    proxied_url: str,
    start_faulty_service: Callable[..., ServerThread],
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    service_log: ServiceLog,
    figures: Callable[[str, str], None],
) -> None:
    _, model = faulty_llm
    model.answer_with(20)
    server = start_faulty_service(database_url=proxied_url, run_lease_s=2.0)
    api = Api(server.base_url)
    try:
        conv = api.create_conversation()
        model.loop_gate.clear()
        run_id = api.start_run(conv, "a question whose run ends while the database is away")
        with api.stream(conv) as live:
            received = live.read(until=thinking)

            def meanwhile() -> None:
                # The whole run finishes during the outage, up to the last answer token.
                model.loop_gate.set()
                received.extend(
                    live.read(until=lambda e: e.event == "answer" and e.data.get("status") == "done")
                )

            outage = cut_for_a_while(proxy, api, service_log, meanwhile)
            restored = time.monotonic()
            received += live.read()
            done_after = time.monotonic() - restored

        done = received[-1]
        assert done.event == "done"
        assert done.data["status"] == "completed", done.data
        assert done.data["answer"] == model.answer
        stored = api.wait_stored(run_id)
        assert_stored_once(received, stored)
        run = api.run(run_id)
        assert (run["status"], run["answer"]) == ("completed", model.answer)
        assert_healthy(api, model)
        assert service_log.problems() == [], service_log.text
        figures("postgres outage at the run's end: outage", f"{outage:.1f}s")
        figures(
            "postgres outage at the run's end: done sent after the database came back", f"{done_after:.2f}s"
        )
    finally:
        api.close()
