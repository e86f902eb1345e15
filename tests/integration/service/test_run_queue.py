"""The run queue through the API (RUNS.md Q-01, Q-02): a full worker queues runs, in order, and
starts each as a place frees; another worker with room takes them at once; an owner at its cap
queues without holding up others; a full queue is 429 and stores nothing; a queued run shows its
place, takes follow-ups and can be cancelled; ``/readyz`` and ``/metrics`` show room and queue."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.db.repositories import RunRepo
from app.db.session import Database
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    service_settings,
    start_service_fixture,
)
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.server import ServerThread, wait_until
from tests.support.services import REDIS_URL

pytestmark = pytest.mark.timeout(40)

ONE_WORKER = pytest.mark.parametrize(
    ("database_backend", "redis_bus"),
    [
        pytest.param("sqlite", False, id="sqlite-memory"),
        pytest.param("postgres", True, id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)
TWO_WORKERS = pytest.mark.parametrize(
    "database_backend",
    [
        pytest.param("sqlite", id="sqlite-redis", marks=pytest.mark.redis),
        pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)


def post_run(api: Api, conversation_id: str, message: str) -> httpx.Response:
    return api.http.post(f"/api/conversations/{conversation_id}/runs", json={"message": message})


def started(api: Api, conversation_id: str, message: str, status: str) -> str:
    response = post_run(api, conversation_id, message)
    assert response.status_code == 202, response.text
    assert response.json()["status"] == status, response.json()
    return str(response.json()["run_id"])


def first_request_with(llm: FakeLLM, text: str) -> int:
    """The index of the first request the model received that carries ``text``."""
    requests = list(llm.agent.requests)
    return next(
        i for i, body in enumerate(requests) if any(text in str(m.get("content")) for m in body["messages"])
    )


def metrics(api: Api) -> dict[str, float]:
    response = api.http.get("/metrics")
    assert response.status_code == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if not sample.labels
    }


def phases(api: Api, run_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in api.events(run_id) if e["event"] == "phase"]


def holder(database_url: str, run_id: str) -> str | None:
    async def read() -> str | None:
        db = Database(database_url)
        try:
            run = await RunRepo(db.sessionmaker).get_any(run_id)
            return run.worker_id if run is not None else None
        finally:
            await db.dispose()

    return run_in_own_loop(read)


@ONE_WORKER
def test_a_full_worker_queues_runs_in_order_and_starts_each_as_a_place_frees(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    redis_bus: bool,
) -> None:
    api = clients(start_service(redis=redis_bus, max_active_runs=1).base_url)
    gated_llm.agent.close_gate()
    convs = [api.create_conversation() for _ in range(3)]
    first = started(api, convs[0], "first question", "running")
    wait_until(lambda: gated_llm.agent.loop_calls >= 1, what="the first run at work")

    second = started(api, convs[1], "second question", "queued")
    third = started(api, convs[2], "third question", "queued")

    assert [api.run(r)["status"] for r in (first, second, third)] == ["running", "queued", "queued"]
    assert phases(api, third) == [{"phase": "queued", "position": 2, "run_id": third}]
    with api.stream(convs[1]) as stream:
        (queued,) = stream.read(1)
    assert (queued.event, queued.data) == ("phase", {"phase": "queued", "position": 1, "run_id": second})
    ready = api.http.get("/readyz").json()
    assert ready["status"] == "ok"  # a full worker is still ready: what it cannot run queues
    assert ready["capacity"] == {
        "max_active_runs": 1,
        "active_runs": 1,
        "room": 0,
        "queued": 2,
        "max_queued_runs": 10000,
    }
    seen = metrics(api)
    assert (
        seen["agentstream_queued_runs"],
        seen["agentstream_run_room"],
        seen["agentstream_run_capacity"],
    ) == (
        2,
        0,
        1,
    )
    assert seen["agentstream_runs_queued_total"] == 2

    gated_llm.agent.gate.set()
    finished = [api.wait_finished(r) for r in (first, second, third)]

    assert [r["status"] for r in finished] == ["completed"] * 3
    assert [r["attempt"] for r in finished] == [1, 1, 1]
    assert first_request_with(gated_llm, "second question") < first_request_with(gated_llm, "third question")
    # A queued run starts as any run does: its queued phase, then its work; nothing resumed.
    assert phases(api, second)[0] == {"phase": "queued", "position": 1, "run_id": second}
    assert "resumed" not in [p["phase"] for p in phases(api, second)]
    assert api.events(second)[-1]["data"]["answer"] == gated_llm.agent.answer
    assert metrics(api)["agentstream_queued_runs"] == 0


@TWO_WORKERS
def test_a_run_queued_on_a_full_worker_is_taken_at_once_by_another_with_room(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    full = start_service(max_active_runs=1, run_lease_s=30.0)
    roomy = start_service(max_active_runs=2, run_lease_s=30.0)
    api = clients(full.base_url)
    gated_llm.agent.close_gate()
    first = started(api, api.create_conversation(), "first question", "running")
    wait_until(lambda: gated_llm.agent.loop_calls >= 1, what="the first run at work")

    second = started(api, api.create_conversation(), "second question", "queued")

    # Taken by the worker with room while the first still holds the full one: no waiting for it.
    wait_until(lambda: api.run(second)["status"] == "running", what="another worker to take the queued run")
    wait_until(lambda: gated_llm.agent.loop_calls >= 2, what="the second run at work")
    assert holder(migrated_database_url, second) == roomy.services.manager.worker_id
    assert api.run(first)["status"] == "running"
    gated_llm.agent.gate.set()
    assert [api.wait_finished(r)["status"] for r in (first, second)] == ["completed", "completed"]
    names = [p["phase"] for p in phases(api, second)]
    assert names[0] == "queued" and "resumed" not in names


@TWO_WORKERS
def test_a_worker_with_room_takes_as_many_queued_runs_as_it_has_places_at_once_and_no_more(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    migrated_database_url: str,
) -> None:
    full = start_service(max_active_runs=1, run_lease_s=30.0)
    api = clients(full.base_url)
    gated_llm.agent.close_gate()
    first = started(api, api.create_conversation(), "first question", "running")
    wait_until(lambda: gated_llm.agent.loop_calls >= 1, what="the first run at work")
    queued = [started(api, api.create_conversation(), f"queued {i}", "queued") for i in range(6)]

    roomy = start_service(max_active_runs=4, run_lease_s=30.0)
    other = clients(roomy.base_url)

    wait_until(lambda: gated_llm.agent.loop_calls >= 5, what="the new worker to start four runs")
    capacity = other.http.get("/readyz").json()["capacity"]
    assert (capacity["active_runs"], capacity["room"], capacity["queued"]) == (4, 0, 2)
    holders = [holder(migrated_database_url, run) for run in queued]
    assert holders[:4] == [roomy.services.manager.worker_id] * 4  # the oldest four, oldest first
    assert [api.run(run)["status"] for run in queued[4:]] == ["queued", "queued"]
    gated_llm.agent.gate.set()
    finished = [api.wait_finished(run) for run in (first, *queued)]
    assert [(r["status"], r["attempt"]) for r in finished] == [("completed", 1)] * 7
    assert [api.events(run)[-1]["data"]["answer"] for run in queued] == [gated_llm.agent.answer] * 6


@ONE_WORKER
def test_an_owner_at_the_cap_queues_without_holding_up_another_owners_runs(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    redis_bus: bool,
) -> None:
    server = start_service(
        redis=redis_bus, max_active_runs=10, max_active_runs_per_owner=1, api_keys="alice:ka,bob:kb"
    )
    alice, bob = clients(server.base_url), clients(server.base_url)
    alice.http.headers["Authorization"] = "Bearer ka"
    bob.http.headers["Authorization"] = "Bearer kb"
    gated_llm.agent.close_gate()
    alice_first = started(alice, alice.create_conversation(), "alice one", "running")
    alice_second = started(alice, alice.create_conversation(), "alice two", "queued")

    bobs = started(bob, bob.create_conversation(), "bob one", "running")

    wait_until(lambda: gated_llm.agent.loop_calls >= 2, what="both owners' first runs at work")
    assert alice.run(alice_second)["status"] == "queued"
    gated_llm.agent.gate.set()
    assert alice.wait_finished(alice_second)["status"] == "completed"
    assert [alice.wait_finished(alice_first)["status"], bob.wait_finished(bobs)["status"]] == [
        "completed"
    ] * 2
    assert first_request_with(gated_llm, "bob one") < first_request_with(gated_llm, "alice two")


@ONE_WORKER
def test_a_full_queue_is_429_and_stores_nothing_and_a_queued_run_can_be_cancelled(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    redis_bus: bool,
) -> None:
    api = clients(start_service(redis=redis_bus, max_active_runs=1, max_queued_runs=1).base_url)
    gated_llm.agent.close_gate()
    first = started(api, api.create_conversation(), "first question", "running")
    waiting_conv = api.create_conversation()
    waiting = started(api, waiting_conv, "waiting question", "queued")
    refused_conv = api.create_conversation()

    refused = post_run(api, refused_conv, "refused question")

    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    assert int(refused.headers["Retry-After"]) > 0
    conversation = api.http.get(f"/api/conversations/{refused_conv}").json()
    assert (conversation["messages"], conversation["active_run_id"]) == ([], None)
    # A queued run is its conversation's active run.
    again = post_run(api, waiting_conv, "another")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "run_active")

    assert api.cancel(waiting_conv).status_code == 202

    done = api.wait_finished(waiting)
    assert (done["status"], done["answer"], done["attempt"]) == ("cancelled", "", 1)
    events = api.events(waiting)
    assert [e["event"] for e in events] == ["phase", "done"]
    assert events[-1]["data"]["status"] == "cancelled"
    # Its place is free: the refused one may queue now, and both runs complete; the cancelled
    # question never reached the model.
    later = started(api, refused_conv, "refused question", "queued")
    gated_llm.agent.gate.set()
    assert [api.wait_finished(r)["status"] for r in (first, later)] == ["completed", "completed"]
    assert not gated_llm.agent.saw("waiting question")


@ONE_WORKER
def test_follow_ups_posted_to_a_queued_run_are_folded_in_when_it_starts(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    redis_bus: bool,
) -> None:
    api = clients(start_service(redis=redis_bus, max_active_runs=1).base_url)
    gated_llm.agent.close_gate()
    first = started(api, api.create_conversation(), "first question", "running")
    conv = api.create_conversation()
    queued = started(api, conv, "queued question", "queued")

    posted = api.interrupt(conv, "and mind the units")

    assert posted.status_code == 202, posted.text
    gated_llm.agent.gate.set()
    assert [api.wait_finished(r)["status"] for r in (first, queued)] == ["completed", "completed"]
    assert gated_llm.agent.saw("and mind the units")
    injected = [e["data"]["content"] for e in api.events(queued) if e["event"] == "inject"]
    assert injected == ["and mind the units"]


@ONE_WORKER
def test_a_run_waiting_for_approval_holds_no_room_and_goes_on_once_a_place_frees(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    redis_bus: bool,
) -> None:
    api = clients(start_service(redis=redis_bus, max_active_runs=1, run_lease_s=30.0).base_url)
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    conv = api.create_conversation(require_approval=["calculator"])
    parked = api.start_run(conv, "what is 6*7?")
    (approval,) = wait_until(
        lambda: (r := api.run(parked))["status"] == "waiting" and r["pending_approvals"],
        what="the run to wait for its approval",
    )

    gated_llm.agent.close_gate()
    busy = started(api, api.create_conversation(), "busy question", "running")
    wait_until(lambda: gated_llm.agent.saw("busy question"), what="the other run at work")
    decided = api.http.post(
        f"/api/conversations/{conv}/approvals/{approval['approval_id']}", json={"decision": "approve"}
    )
    assert decided.status_code == 200, decided.text

    # The approved run needs a place: it goes on once the busy one ends.
    gated_llm.agent.gate.set()
    assert [api.wait_finished(r)["status"] for r in (busy, parked)] == ["completed", "completed"]
    assert api.wait_finished(parked)["answer"] == gated_llm.agent.answer


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "database_backend", [pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis])]
)
def test_queued_runs_survive_every_worker_killed_and_a_new_one_runs_them_all(
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    migrated_database_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    cluster = Cluster(migrated_database_url, gated_llm, redis_prefix, tmp_path)
    try:
        one, two = cluster.start(2, MAX_ACTIVE_RUNS="1", RUN_LEASE_S="30")
        apis = [clients(one.base_url), clients(two.base_url)]
        gated_llm.agent.close_gate()
        running = [
            started(api, api.create_conversation(), f"running {i}", "running") for i, api in enumerate(apis)
        ]
        wait_until(lambda: gated_llm.agent.loop_calls >= 2, what="both workers at work")
        queued = [
            started(api, api.create_conversation(), f"queued {i}", "queued") for i, api in enumerate(apis)
        ]

        one.kill()
        two.kill()

        # The next worker (of this host: the dead ones' runs need not wait for their leases).
        settings = service_settings(
            migrated_database_url,
            gated_llm.base_url,
            redis_url=REDIS_URL,
            redis_key_prefix=redis_prefix,
            max_active_runs=2,
            run_lease_s=30.0,
        )
        successor = ServerThread(settings).start()
        try:
            api = clients(successor.base_url)
            gated_llm.agent.gate.set()
            finished = [api.wait_finished(r, timeout=30) for r in running + queued]
        finally:
            successor.stop()
    finally:
        cluster.close()

    assert [r["status"] for r in finished] == ["completed"] * 4
    # The runs at work were resumed; the queued ones started as first attempts.
    assert [r["attempt"] for r in finished] == [2, 2, 1, 1]
    assert {r["answer"] for r in finished} == {gated_llm.agent.answer}
